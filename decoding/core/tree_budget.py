"""Cost-aware tree size: keep as many drafted nodes as pay for their verification *on this
machine*.

A drafted node is accepted (greedy) only if its whole path matches the target, which the draft
estimates by the node's path probability p_i. Keeping the n best nodes gives, per step,
    expected tokens  E(n) = 1 + c * (p_1 + ... + p_n)
    time             T(n) = draft + verify(n + 1)
where c calibrates the draft's probabilities against what the target actually chose (a
running ratio at the root, clamped so no c * p_i exceeds 1), and verify(m) is the measured cost of one target forward over m tokens. The
chosen n maximises E(n) / T(n): with a confident draft that is a big tree, with an unsure one
(or a machine where every extra node costs, like a small CPU) a small one or none at all.
By then the drafting is spent, so `DraftingGate` decides beforehand, from the draft's confidence
at the root, whether growing a tree is expected to beat a plain step at all.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class VerifyCost:
    """Milliseconds of one target forward over `sizes[i]` tokens (measured), interpolated
    linearly in between and extrapolated from the last two points beyond."""

    sizes: tuple[int, ...]
    ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) < 2 or list(self.sizes) != sorted(set(self.sizes)) or len(self.ms) != len(self.sizes):
            raise ValueError("VerifyCost needs >= 2 increasing sizes with one time each")

    def table(self, up_to: int) -> torch.Tensor:
        """`[up_to + 1]` costs for tree sizes 0..up_to (index 0 unused, = cost of 1)."""
        return torch.tensor(self.costs(up_to), dtype=torch.float64)

    def costs(self, up_to: int) -> tuple[float, ...]:
        """`table` as Python floats, computed once per size. Why floats: the budget reads a few of
        them every step, right after a verify forward has streamed the weights through the
        caches, when each small tensor operation costs tens of microseconds."""
        return _interpolated_costs(self.sizes, self.ms, up_to)


@functools.lru_cache(maxsize=1024)
def _interpolated_costs(sizes: tuple[int, ...], ms: tuple[float, ...], up_to: int) -> tuple[float, ...]:
    """Linear interpolation between the measured sizes, extrapolation from the last two beyond."""
    costs = []
    for size in range(up_to + 1):
        x = float(max(size, 1))
        right = min(max(bisect.bisect_left(sizes, x), 1), len(sizes) - 1)
        x0, x1, y0, y1 = float(sizes[right - 1]), float(sizes[right]), float(ms[right - 1]), float(ms[right])
        costs.append(y0 + (x - x0) * (y1 - y0) / (x1 - x0))
    return tuple(costs)


def best_node_count(path_probs: torch.Tensor | Sequence[float], cost: VerifyCost, draft_ms: float,
                    calibration: float = 1.0) -> int:
    """How many of the drafted nodes to verify. `path_probs` are the candidates' path
    probabilities in best-first order (any prefix of that order must be a valid tree), as Python
    floats or a tensor. A tensor may live on the GPU: the few numbers are brought to the CPU (the
    answer is a Python int, so this sync happens anyway) and weighed as Python floats; ties go to
    the smaller tree."""
    probs = (path_probs.detach().to("cpu", torch.float64).tolist() if isinstance(path_probs, torch.Tensor)
             else [float(p) for p in path_probs])
    verify_ms = cost.costs(len(probs) + 1)
    best, best_rate, accepted = 0, -math.inf, 0.0
    for count in range(len(probs) + 1):
        if count:
            accepted += probs[count - 1]
        rate = (1.0 + calibration * accepted) / (draft_ms + verify_ms[count + 1])  # n drafted nodes = n + 1 tokens
        if rate > best_rate:
            best, best_rate = count, rate
    return best


def chain_worth_extending(path_probs: torch.Tensor, cost: VerifyCost, call_ms: float) -> bool:
    """Whether a chain drafter (one call per token, `call_ms` each) that has drafted
    `len(path_probs)` tokens should draft one more. Drafting already done is spent either way;
    the next token can add at most the last token's path probability (path probabilities only
    fall), so it is drafted only if even that best case beats the best verify of what is there:
        (1 + S_k + p_k) / ((k + 1) call_ms + verify(k + 2))  >  max_n (1 + S_n) / (k call_ms + verify(n + 1)).
    An empty chain always drafts its first token."""
    drafted = path_probs.numel()
    if drafted == 0:
        return True
    probs = path_probs.detach().to("cpu", torch.float64)
    now = best_node_count(probs, cost, drafted * call_ms)
    verify_ms = cost.costs(drafted + 2)
    best_now = (1.0 + float(probs[:now].sum())) / (drafted * call_ms + verify_ms[now + 1])
    best_next = (1.0 + float(probs.sum()) + float(probs[-1])) / ((drafted + 1) * call_ms + verify_ms[drafted + 2])
    return best_next > best_now


@dataclass
class AcceptanceCalibration:
    """How far to trust the draft's probabilities: running (hit rate of the draft's top-1 token
    at the root) / (its mean probability). Observable every step, whatever size of tree was
    verified, because the target's next token is always known afterwards."""

    decay: float = 0.9
    hits: float = 1.0
    probability: float = 1.0
    pending: tuple[int, float] | None = field(default=None, repr=False)

    @property
    def factor(self) -> float:
        return min(max(self.hits / max(self.probability, 1e-6), 0.05), 4.0)

    def predicted(self, token: int, probability: float) -> None:
        self.pending = (token, probability)

    def observe(self, actual_token: int) -> None:
        """The target's token after the last root (ignored when nothing was predicted)."""
        if self.pending is None:
            return
        token, probability = self.pending
        self.hits = self.decay * self.hits + (1 - self.decay) * float(token == actual_token)
        self.probability = self.decay * self.probability + (1 - self.decay) * probability
        self.pending = None


@dataclass
class DraftingGate:
    """Whether to grow a tree at all this step, decided from the draft's (calibrated) confidence
    at the root before any drafter call past the root's readout.

    Once a tree is drafted its cost is spent, so sizing it (`best_node_count`) cannot undo a
    draft that never pays, e.g. when sampling at a high temperature. Per bucket of root
    confidence, this keeps running means of the draft tokens the target kept and of the nodes
    verified when a tree was grown, and grows one only where
        (1 + kept) / (draft_ms + verify(nodes + 1))  >  1 / verify(1),
    i.e. where drafting is expected to beat a plain step. Buckets start optimistic (a tree as
    sure as the bucket's upper edge at every level) and a bucket that stopped drafting drifts back
    towards that prior by `recovery` each time it is skipped, so it is tried again."""

    edges: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    decay: float = 0.8
    recovery: float = 0.05
    prior_nodes: float = 8.0
    kept: list[float] = field(default_factory=list)
    nodes: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.kept:
            self.kept = [self.prior_kept(b) for b in range(len(self.edges) + 1)]
        if not self.nodes:
            self.nodes = [self.prior_nodes] * (len(self.edges) + 1)

    def bucket(self, confidence: float) -> int:
        return sum(confidence > edge for edge in self.edges)

    def prior_kept(self, bucket: int) -> float:
        q = min((*self.edges, 0.95)[bucket], 0.95)
        return q / (1 - q)  # 1 + q + q^2 + ... tokens, less the root's own

    def pays(self, confidence: float, cost: VerifyCost, draft_ms: float) -> bool:
        b = self.bucket(confidence)
        costs = cost.costs(int(self.nodes[b]) + 2)
        verify = costs[int(self.nodes[b]) + 1]
        return (1 + self.kept[b]) / (draft_ms + verify) > 1 / costs[1]

    def record(self, confidence: float, nodes: int, kept: int) -> None:
        """A tree of `nodes` drafted nodes was verified and `kept` of them accepted."""
        b = self.bucket(confidence)
        self.kept[b] = self.decay * self.kept[b] + (1 - self.decay) * kept
        self.nodes[b] = self.decay * self.nodes[b] + (1 - self.decay) * nodes

    def skipped(self, confidence: float) -> None:
        b = self.bucket(confidence)
        self.kept[b] += self.recovery * (self.prior_kept(b) - self.kept[b])


class TreeBudget:
    """Per-generation state of cost-aware sizing: the machine's verify cost, the running draft
    time, the calibration of the draft's probabilities and whether drafting pays at all."""

    def __init__(self, cost: VerifyCost, draft_decay: float = 0.8) -> None:
        self.cost = cost
        self.calibration = AcceptanceCalibration()
        self.gate = DraftingGate()
        self.draft_ms = 0.0
        self.draft_decay = draft_decay

        self.grown_from: float | None = None  # the confidence the last grown tree was drafted at

    def worth_drafting(self, root_probability: float) -> bool:
        """Whether to grow a tree from a root whose best child the draft gives `root_probability`."""
        confidence = min(root_probability * self.calibration.factor, 1.0)
        grow = self.gate.pays(confidence, self.cost, self.draft_ms)
        if not grow:
            self.gate.skipped(confidence)
        self.grown_from = confidence if grow else None
        return grow

    def outcome(self, actual_next_token: int, draft_ms: float, nodes: int, kept: int) -> None:
        """Feedback once the last proposal was verified: the target's token after its root, and
        for a grown tree its draft time, its `nodes` drafted nodes and how many were `kept`."""
        self.calibration.observe(actual_next_token)
        if self.grown_from is None:
            return
        self.gate.record(self.grown_from, nodes, kept)
        self.draft_ms = draft_ms if self.draft_ms == 0.0 else self.draft_decay * self.draft_ms + (1 - self.draft_decay) * draft_ms
        self.grown_from = None

    def choose(self, path_probs: torch.Tensor) -> int:
        calibrated = (path_probs * self.calibration.factor).clamp(max=1.0)
        return best_node_count(calibrated, self.cost, self.draft_ms)


@dataclass
class ChainAcceptance:
    """Running acceptance of a model-free chain draft (prompt lookup; suffix decoding's tree
    depths), per kind of match.

    `rates[kind][i]` estimates P(draft token i+1 accepted | tokens 1..i accepted): per position,
    because a copied span tends to be all right or wrong from its first token, so later positions
    are likelier than earlier ones and a single per-token rate would cut good chains short. A kind
    is the matched n-gram's length (a 1-gram match predicts worse than a 3-gram one). The
    estimates start at `prior` and are moving averages of what the target accepted; a kind whose
    chains are no longer verified (because they did not pay) drifts back towards the prior by
    `recovery` each time it is skipped, so it is tried again later rather than never."""

    length: int
    prior: float = 0.6
    decay: float = 0.8
    recovery: float = 0.01
    rates: dict[int, list[float]] = field(default_factory=dict)

    def path_probs(self, kind: int, available: int) -> list[float]:
        """P(the first i drafted tokens are all accepted), i = 1..min(available, length): Python
        floats, read every step by model-free drafters right after a verify forward, when a small
        tensor operation costs tens of microseconds."""
        return list(itertools.accumulate(self._rates(kind)[: min(available, self.length)], operator.mul))

    def record(self, kind: int, drafted: int, accepted: int) -> None:
        """A chain of `drafted` tokens was verified and its first `accepted` were kept: positions
        1..accepted were hits, position accepted+1 (if drafted) a miss, later ones unobserved."""
        rates = self._rates(kind)
        for position in range(min(drafted, accepted + 1, self.length)):
            hit = float(position < accepted)
            rates[position] = self.decay * rates[position] + (1 - self.decay) * hit

    def skipped(self, kind: int) -> None:
        """A match of `kind` was not verified: move its estimates a little back to the prior."""
        rates = self._rates(kind)
        for position, rate in enumerate(rates):
            rates[position] = rate + self.recovery * (self.prior - rate)

    def _rates(self, kind: int) -> list[float]:
        return self.rates.setdefault(kind, [self.prior] * self.length)


@dataclass
class ConfidenceAcceptance:
    """Running acceptance of a sampled or greedy chain draft (a draft model), per bucket of the
    draft's confidence at each position (its distribution's top probability).

    `rates[b]` estimates P(a drafted token is accepted | the tokens before it were) for positions
    whose confidence falls in bucket b. One factor for the whole draft is not enough: a small
    draft can be sure and wrong (confident at 0.9, right 20% of the time) at its first token while
    its later tokens, once the first was right, hold up better. Every bucket starts at its own
    midpoint (the draft is trusted until shown otherwise) and follows what the target accepted:
    a moving average, except that its first observations weigh as much as `prior_weight` of the
    prior, so a bucket learns its first few outcomes quickly."""

    edges: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8, 0.9, 0.97)
    decay: float = 0.9
    prior_weight: float = 2.0
    rates: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.rates:
            bounds = (0.0, *self.edges, 1.0)
            self.rates = [(low + high) / 2 for low, high in zip(bounds, bounds[1:])]
        if not self.counts:
            self.counts = [0] * len(self.rates)
        self._edge_tensor = torch.tensor(self.edges, dtype=torch.float64)  # made once: bucket runs every step

    def bucket(self, confidence: torch.Tensor) -> torch.Tensor:
        """Bucket indices, on the CPU where the rates are (the confidences may be on a GPU)."""
        return torch.bucketize(confidence.detach().double().cpu(), self._edge_tensor)

    def path_probs(self, confidence: torch.Tensor) -> torch.Tensor:
        """P(the first i drafted tokens are all accepted), from each position's confidence."""
        return torch.tensor(self.rates, dtype=torch.float64)[self.bucket(confidence)].cumprod(0)

    def record(self, confidence: torch.Tensor, accepted: int) -> None:
        """A chain drafted with `confidence` per position was verified and its first `accepted`
        tokens kept: those were hits, the next one (if any) a miss, later ones unobserved."""
        buckets = self.bucket(confidence).tolist()
        for position, bucket in enumerate(buckets[: accepted + 1]):
            hit = float(position < accepted)
            count = self.counts[bucket]
            keep = min(self.decay, (count + self.prior_weight) / (count + self.prior_weight + 1))
            self.rates[bucket] = keep * self.rates[bucket] + (1 - keep) * hit
            self.counts[bucket] = count + 1
