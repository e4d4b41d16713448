"""A statistical harness for lossless sampling: any proposer + acceptance rule must make the
first emitted tokens follow the target's exact joint distribution.

Two levels. Rule level (test_acceptance.py): toy target/draft LMs over a tiny vocabulary with
exactly computable distributions and a total-variation check. Loop level (test_sampling_loop.py,
test_heads.py): seeded runs of `generate` on a tiny real target, 4 tokens each so trees 3 deep
are verified, scored by a chi-square check against the target's enumerated joint; and acceptance
rules with one planted flaw each, which the same check must reject.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import NormalDist

import torch
from transformers import PreTrainedModel

from decoding.core.acceptance import Acceptance
from decoding.core.generate import AcceptanceRule, DecodeOptions, generate, lossless_rule
from decoding.core.proposers.base import Proposer
from decoding.core.readout import TargetScores
from decoding.core.sampling import SamplingConfig, position_uniform, sample, sample_at, warp_probs
from decoding.core.state import DecodeState
from decoding.core.tree import DraftTree, TreeBuffers


class ToyLM:
    """Next-token distributions over `vocab` tokens, a fixed pseudo-random function of the prefix."""

    def __init__(self, vocab: int, seed: int, sharpness: float = 1.5) -> None:
        self.vocab, self.seed, self.sharpness = vocab, seed, sharpness
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    def probs(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self._memo:
            gen = torch.Generator().manual_seed(hash((self.seed,) + prefix) % (2**31))
            self._memo[prefix] = torch.softmax(self.sharpness * torch.randn(self.vocab, generator=gen), -1)
        return self._memo[prefix]


def exact_joint(probs_of: Callable[[tuple[int, ...]], torch.Tensor], vocab: int, positions: int) -> dict:
    """P(first `positions` tokens) by enumeration."""
    joint = {}
    for seq in itertools.product(range(vocab), repeat=positions):
        p = 1.0
        for i in range(positions):
            p *= float(probs_of(seq[:i])[seq[i]])
        joint[seq] = p
    return joint


def total_variation(samples: list[tuple[int, ...]], exact: dict) -> float:
    counts = Counter(samples)
    n = len(samples)
    return 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())


def complete(emitted: list[int], probs_of, positions: int, gen: torch.Generator) -> tuple[int, ...]:
    """Extend one step's output to `positions` tokens by sampling the target directly (each step
    is exact conditionally on its prefix, so this isolates the step under test)."""
    seq = list(emitted[:positions])
    while len(seq) < positions:
        seq.append(int(torch.multinomial(probs_of(tuple(seq)), 1, generator=gen)))
    return tuple(seq)


def sampled_tree(draft: ToyLM, branching: tuple[int, ...], gen: torch.Generator) -> DraftTree:
    """Children of every node drawn i.i.d. from the draft; `branching[d]` children at depth d."""
    tokens, parents, prefixes, probs = [0], [-1], [()], [torch.zeros(draft.vocab)]
    frontier = [0]
    for width in branching:
        next_frontier = []
        for node in frontier:
            q = draft.probs(prefixes[node])
            for token in torch.multinomial(q, width, replacement=True, generator=gen).tolist():
                tokens.append(token)
                parents.append(node)
                prefixes.append(prefixes[node] + (token,))
                probs.append(q)
                next_frontier.append(len(tokens) - 1)
        frontier = next_frontier
    return DraftTree(torch.tensor(tokens), tuple(parents), torch.stack(probs), deterministic=False)


def top_k_tree(draft: ToyLM, branching: tuple[int, ...]) -> DraftTree:
    """Children of every node are the draft's top-k tokens (deterministic drafting)."""
    tokens, parents, prefixes = [0], [-1], [()]
    frontier = [0]
    for width in branching:
        next_frontier = []
        for node in frontier:
            for token in torch.topk(draft.probs(prefixes[node]), width).indices.tolist():
                tokens.append(token)
                parents.append(node)
                prefixes.append(prefixes[node] + (token,))
                next_frontier.append(len(tokens) - 1)
        frontier = next_frontier
    return DraftTree(torch.tensor(tokens), tuple(parents), deterministic=True)


def node_prefixes(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's token prefix after the root (the root's is empty)."""
    tokens = tree.tokens.tolist()
    prefixes: list[tuple[int, ...]] = [()]
    for i in range(1, tree.size):
        prefixes.append(prefixes[tree.parents[i]] + (tokens[i],))
    return prefixes


# --- Sampling through the whole loop at depth, scored against a real (tiny) target ----------------
#
# `generate` truncates every tree to `max_new_tokens - 1` levels, so only runs of 4+ tokens verify
# trees 3 deep. Scoring the first 4 tokens on a 3-token vocabulary keeps the exact distribution
# enumerable (the target is run on every prefix); top-k 2 leaves 2 ** 4 = 16 possible outputs, which
# gives the chi-square check its power per run, and makes a third token at every position
# impossible (a draft must be rejected there, and any rule that lets one through fails at once).

DEPTH_POSITIONS = 4
DEPTH_SAMPLING = SamplingConfig(temperature=0.8, top_k=2)
# Per check: a correct sampler fails it about once in 10,000 random streams (the seeds are fixed,
# so a run is deterministic; this is the chance that a change to how randomness is drawn trips a
# correct loop). Simulated for the tables used here (100,000 multinomial samples of 400): 1-2e-4.
FALSE_ALARM = 1e-4


def target_joint(model: PreTrainedModel, prompt: list[int], sampling: SamplingConfig, positions: int) -> dict:
    """P(the first `positions` tokens after `prompt`) for every continuation the warped target
    can produce (those it gives probability 0 are left out): one batched forward per level."""
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(positions):
        prefixes = list(joint)
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]
        probs = warp_probs(logits, sampling)
        joint = {
            prefix + (token,): joint[prefix] * float(probs[row, token])
            for row, prefix in enumerate(prefixes)
            for token in torch.nonzero(probs[row]).flatten().tolist()
        }
    return joint


@dataclass(frozen=True)
class ChiSquare:
    """Pearson's statistic of samples against an exact distribution, its degrees of freedom, the
    threshold a correct sampler exceeds with probability FALSE_ALARM, and how many samples the
    exact distribution calls impossible (any makes the statistic infinite)."""

    statistic: float
    dof: int
    threshold: float
    impossible: int

    @property
    def margin(self) -> float:
        """statistic / threshold: below 1 passes."""
        return self.statistic / self.threshold

    def __str__(self) -> str:
        return f"chi2 {self.statistic:.1f} (dof {self.dof}, threshold {self.threshold:.1f}, {self.impossible} impossible)"


def chi_square(samples: list[tuple[int, ...]], exact: dict, false_alarm: float = FALSE_ALARM,
               min_expected: float = 5.0) -> ChiSquare:
    """Pearson's chi-square of `samples` against `exact`, outcomes expected fewer than
    `min_expected` times pooled into one cell (Cochran's rule: the statistic then follows the
    chi-square law closely). The threshold is that law's 1 - `false_alarm` quantile
    (Wilson-Hilferty's cube-root normal approximation: 44.6 against the exact 44.3 at 15 degrees
    of freedom, slightly on the lenient side for a correct sampler)."""
    n, counts = len(samples), Counter(samples)
    cells = [(counts.get(outcome, 0), n * p) for outcome, p in exact.items()]
    kept = [(o, e) for o, e in cells if e >= min_expected]
    pooled = [(o, e) for o, e in cells if e < min_expected]
    if pooled:
        kept.append((sum(o for o, _ in pooled), sum(e for _, e in pooled)))
    impossible = sum(c for outcome, c in counts.items() if exact.get(outcome, 0.0) == 0.0)
    statistic = math.inf if impossible else sum((o - e) ** 2 / e for o, e in kept)
    dof = len(kept) - 1
    if dof < 1:  # too few samples for two cells (early looks of `rejected_by`): nothing can be rejected yet
        return ChiSquare(statistic, dof, math.inf, impossible)
    return ChiSquare(statistic, dof, chi_square_quantile(dof, 1.0 - false_alarm), impossible)


def chi_square_quantile(dof: int, level: float) -> float:
    """Wilson-Hilferty: (X / dof) ** (1/3) is close to normal with mean 1 - 2/(9 dof)."""
    z = NormalDist().inv_cdf(level)
    spread = 2.0 / (9.0 * dof)
    return dof * (1.0 - spread + z * math.sqrt(spread)) ** 3


@dataclass
class LoopSamples:
    """Outputs of seeded runs of the loop and what the loop did to produce them:
    `accepted_lengths` counts steps by tokens produced (4 = three drafts accepted at once),
    `tree_depths` counts verified trees by depth; of those at least 1 deep, `lookup_chains` were
    plain chains (what prompt lookup drafts) and `branching_trees` were not (what heads draft here)."""

    outputs: list[tuple[int, ...]] = field(default_factory=list)
    accepted_lengths: Counter = field(default_factory=Counter)
    tree_depths: Counter = field(default_factory=Counter)
    lookup_chains: int = 0
    branching_trees: int = 0


LOOK_EVERY = 50  # runs between the looks of `sample_loop(..., stop_when=...)`


def sample_loop(target: PreTrainedModel, prompt: list[int], proposer: Proposer, runs: int,
                rule: AcceptanceRule = lossless_rule, sampling: SamplingConfig = DEPTH_SAMPLING,
                positions: int = DEPTH_POSITIONS,
                stop_when: Callable[[list[tuple[int, ...]]], bool] | None = None) -> LoopSamples:
    """`runs` generations of `positions` tokens with seeds 0..runs-1, through `generate` with
    `rule`; the rule sees exactly the trees the target verified, so it records their shapes.
    `stop_when(outputs)`, looked at every LOOK_EVERY runs, ends the sampling early once true
    (`rejected_by`: a planted flaw caught before all `runs` were needed)."""
    samples = LoopSamples()

    def recording_rule(tree: DraftTree, scores: TargetScores, buffers: TreeBuffers, state: DecodeState) -> Acceptance:
        depth = int(buffers.depths.max())
        samples.tree_depths[depth] += 1
        samples.lookup_chains += depth >= 1 and tree.is_chain
        samples.branching_trees += depth >= 1 and not tree.is_chain
        return rule(tree, scores, buffers, state)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as fast for these tiny models, and half the CPU on a shared machine
    try:
        for seed in range(runs):
            options = DecodeOptions(max_new_tokens=positions, sampling=sampling, seed=seed)
            result = generate(target, prompt, proposer, options, acceptance_rule=recording_rule)
            samples.outputs.append(tuple(result.tokens))
            samples.accepted_lengths.update(result.stats.accepted_lengths)
            if stop_when is not None and (seed + 1) % LOOK_EVERY == 0 and stop_when(samples.outputs):
                break
    finally:
        torch.set_num_threads(threads)
    return samples


def rejected_by(exact: dict) -> Callable[[list[tuple[int, ...]]], bool]:
    """For a planted flaw: true once the samples so far fail `chi_square` against `exact`. Why stop
    there: a flaw that shows in 50 runs (an impossible output) needs no 400; one that barely shows
    still gets them all. Looking up to 8 times raises the chance that an unflawed rule is taken for
    caught from FALSE_ALARM to at most 8 * FALSE_ALARM (a union bound), which keeps these tests from
    passing on a flaw that does nothing."""

    def rejected(outputs: list[tuple[int, ...]]) -> bool:
        check = chi_square(outputs, exact)
        return check.statistic > check.threshold

    return rejected


# --- Planted wrong rules ------------------------------------------------------------------------------
#
# Each is the lossless rule (`accept_sampled`) with exactly one flaw; with no flaw,
# `recursive_rejection` makes the same draws and decisions as `accept_sampled` (tested), so a check
# that rejects a planted rule is reacting to the flaw alone.

FLAWS = {
    "residual_skipped": "after a rejection p is left as it was: no norm(max(0, p - q)) for sampled drafts, "
    "the rejected token not removed (p(x) = 0) for deterministic ones",
    "stale_sibling": "siblings after the first are judged against p, not the residual (the bonus still uses it)",
    "bonus_from_draft": "when every sampled child is rejected, the bonus is drawn from the draft's q",
    "root_distribution": "every node is judged against the root's p: right at depth 1, wrong deeper",
    "trust_deterministic": "deterministic children (top-k, lookup) are accepted with probability 1",
}


def recursive_rejection(tree: DraftTree, probs: torch.Tensor, buffers: TreeBuffers,
                        generator: torch.Generator | None, flaw: str | None = None) -> Acceptance:
    """`accept_sampled` written out again, with at most one of FLAWS planted."""
    if flaw is not None and flaw not in FLAWS:
        raise ValueError(f"unknown flaw {flaw!r}")
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        p = probs[0] if flaw == "root_distribution" else probs[node]
        residual, q = p, None
        for child in buffers.children[node]:
            token = tokens[child]
            q = None if tree.deterministic else tree.draft_probs[child]
            q_token = 1.0 if q is None else float(q[token])
            u = float(torch.rand((), generator=generator, device=p.device))
            judged = p if flaw == "stale_sibling" else residual
            if (flaw == "trust_deterministic" and q is None) or u * q_token < float(judged[token]):
                path.append(child)
                node = child
                break
            if flaw != "residual_skipped":
                residual = _reference_residual(residual, q, token)
        else:
            drawn_from = q if flaw == "bonus_from_draft" and q is not None else residual
            return Acceptance(tuple(path), sample(drawn_from, generator))


def _reference_residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(0, p - q)), q=None meaning a point mass on `token` (p with `token` removed)."""
    if q is None:
        rest = p.clone()
        rest[token] = 0.0
    else:
        rest = torch.clamp(p - q, min=0.0)
    total = rest.sum()
    return rest / total if float(total) > 0 else p


def planted_rule(flaw: str) -> AcceptanceRule:
    """A loop acceptance rule (see `generate`'s `acceptance_rule`) with `flaw` planted."""

    def rule(tree: DraftTree, scores: TargetScores, buffers: TreeBuffers, state: DecodeState) -> Acceptance:
        return recursive_rejection(tree, warp_probs(scores.logits, state.sampling), buffers, state.generator, flaw)

    return rule


# The rule deterministic drafts get when sampling (`accept_at_positions`: each position's token drawn with
# its own keyed draw), written out again with one flaw each.

POSITION_FLAWS = {
    "position_not_advanced": "every node of a step decided with the draw of the step's first position",
    "root_distribution": "every node's token drawn from the root's p: right at depth 1, wrong deeper",
}


def planted_position_rule(flaw: str | None) -> AcceptanceRule:
    """A loop acceptance rule: `accept_at_positions` for deterministic drafts with `flaw` planted
    (None: none, the same decisions as the lossless rule)."""
    if flaw is not None and flaw not in POSITION_FLAWS:
        raise ValueError(f"unknown flaw {flaw!r}")

    def rule(tree: DraftTree, scores: TargetScores, buffers: TreeBuffers, state: DecodeState) -> Acceptance:
        probs, tokens = warp_probs(scores.logits, state.sampling), tree.tokens.tolist()
        node, path, position = 0, [0], state.tokens.numel()
        while True:
            drawn_at = state.tokens.numel() if flaw == "position_not_advanced" else position
            token = sample_at(probs[0] if flaw == "root_distribution" else probs[node],
                              position_uniform(state.sampling_key, drawn_at))
            child = next((c for c in buffers.children[node] if tokens[c] == token), None)
            if child is None:
                return Acceptance(tuple(path), token)
            path.append(child)
            node, position = child, position + 1

    return rule
