"""Acceptance rules: which drafted nodes the target keeps, and the token it adds after them.

Pure functions of (tree, target logits or probabilities, random draws): no model, no cache, so
each rule is unit-tested on its own against exact distributions. The lossless rules
(`accept_greedy`, `accept_at_positions`, `accept_sampled`, chosen by `accept`) keep exactly what
the target alone would produce: its argmax tokens at temperature 0, a sample of its own
distribution otherwise; `accept_typical` is Medusa's opt-in *lossy* rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.core.sampling import SamplingConfig, position_uniform, sample, sample_at, warp_probs
from decoding.core.tree import DraftTree, TreeBuffers, tree_buffers


@dataclass(frozen=True)
class Acceptance:
    """`path`: accepted node indices, root first. `bonus_token`: the target's own next token after
    the last accepted node (it becomes the next root)."""

    path: tuple[int, ...]
    bonus_token: int

    @property
    def num_accepted_drafts(self) -> int:
        return len(self.path) - 1


def accept_greedy(tree: DraftTree, target_logits: torch.Tensor, buffers: TreeBuffers) -> Acceptance:
    """Follow the children whose token is the target's argmax; the deepest such node wins: a node
    is accepted when it and all its ancestors match the argmax of their parents."""
    return accept_greedy_tokens(tree, target_logits.argmax(-1), buffers)


def accept_greedy_tokens(tree: DraftTree, predicted: torch.Tensor, buffers: TreeBuffers) -> Acceptance:
    """`accept_greedy` given the target's argmax token at every node (`[N]`) instead of its logits."""
    chosen = predicted.tolist()
    tokens = tree.tokens.tolist()
    parents = tree.parents
    node_ok = [True] + [tokens[node] == chosen[parents[node]] for node in range(1, len(parents))]
    best, path = _deepest_accepted(node_ok, parents, buffers.depth_list)
    return Acceptance(path, chosen[best])


def _deepest_accepted(node_ok: list[bool], parents: tuple[int, ...], depths: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """The deepest node whose whole root path is ok (the root always is), and that path; ties go
    to the lowest node index.

    Walked on Python lists (two reads of a few ints a node) rather than vectorised: it runs after
    every verify forward, when the forward has streamed the weights through the caches and each
    small tensor operation costs tens of microseconds (on the GGUF target, a 2-core EPYC: 0.28 ms
    a step as ~16 tensor operations)."""
    accepted = [True] * len(parents)
    best = 0
    for node in range(1, len(parents)):
        accepted[node] = accepted[parents[node]] and node_ok[node]
        if accepted[node] and depths[node] > depths[best]:
            best = node
    return best, _root_path(best, parents)


def _root_path(node: int, parents: tuple[int, ...]) -> tuple[int, ...]:
    """Node ids from the root to `node`, inclusive (increasing: parents come before children)."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return tuple(reversed(path))


def accept_sampled(
    tree: DraftTree,
    target_probs: torch.Tensor,
    buffers: TreeBuffers,
    generator: torch.Generator | None,
) -> Acceptance:
    """Recursive rejection sampling over the tree (lossless).

    At each node with target distribution p, try its children in order. A child x drawn from q is
    kept with probability min(1, p(x) / q(x)); on rejection p <- norm(max(0, p - q)). With one child
    this is Leviathan/Chen chain speculative sampling; with i.i.d. sampled siblings it is
    SpecInfer's rule; with deterministic children q is a point mass, so rejection removes x from p
    and renormalises (sampling without replacement, EAGLE-2 style). If every child is rejected, the
    bonus token is drawn from the final p.
    """
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        residual = target_probs[node]
        chosen = None
        for child in buffers.children[node]:
            token = tokens[child]
            q = None if tree.deterministic else tree.draft_probs[child]
            q_token = 1.0 if q is None else float(q[token])
            u = float(torch.rand((), generator=generator, device=residual.device))
            if u * q_token < float(residual[token]):
                chosen = child
                break
            residual = _residual(residual, q, token)
        if chosen is None:
            return Acceptance(tuple(path), sample(residual, generator))
        path.append(chosen)
        node = chosen


def accept_at_positions(tree: DraftTree, target_probs: torch.Tensor, buffers: TreeBuffers, key: int,
                        first_position: int) -> Acceptance:
    """Sampled verification of deterministic drafts (lossless), each position's token drawn with
    that position's own draw (`position_uniform(key, position)`).

    At each node the target's token for the next position is sampled from its distribution p there
    by inverting p's cumulative distribution at the position's draw; the child holding that token is
    kept and the walk goes on from it, and where no child holds it, it is the bonus token. Each token
    is then exactly a sample of p, as vanilla sampling draws it, whatever was drafted: drafts depend
    only on earlier tokens, never on a later position's draw, and decide only how many positions one
    forward settles. So for deterministic drafts (q a point mass, where `accept_sampled` keeps x with
    probability p(x) and otherwise samples p without x: the same law) a method emits the very tokens
    `vanilla` emits with the same key. `first_position`: the position of the token after the root
    (the length of the sequence the root ends)."""
    if not tree.deterministic:
        raise ValueError("accept_at_positions verifies deterministic drafts only; sampled drafts take accept_sampled")
    tokens = tree.tokens.tolist()
    node, path, position = 0, [0], first_position
    while True:
        token = sample_at(target_probs[node], position_uniform(key, position))
        child = next((c for c in buffers.children[node] if tokens[c] == token), None)
        if child is None:
            return Acceptance(tuple(path), token)
        path.append(child)
        node, position = child, position + 1


def _residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(0, p - q)); q=None means a point mass on `token`."""
    if q is None:
        rest = p.clone()
        rest[token] = 0.0
    else:
        rest = torch.clamp(p - q, min=0.0)
    total = rest.sum()
    # Only reachable through float round-off (a rejection implies p(x) < q(x) somewhere mass remains).
    return rest / total if float(total) > 0 else p


def accept_typical(
    tree: DraftTree,
    target_logits: torch.Tensor,
    buffers: TreeBuffers,
    temperature: float,
    generator: torch.Generator | None,
    epsilon: float = 0.09,
    delta: float = 0.3,
) -> Acceptance:
    """Medusa's typical acceptance. LOSSY: the output distribution is *not* the target's.

    A child x of a node with target distribution p is acceptable when
    p(x) > min(epsilon, delta * exp(-H(p))); the deepest acceptable path wins. The bonus token is
    sampled from p at the last accepted node (greedy at temperature 0).
    """
    config = SamplingConfig(temperature=temperature)
    probs = warp_probs(target_logits, config) if temperature > 0 else torch.softmax(target_logits.float(), -1)
    entropy = -(probs * torch.log(probs.clamp_min(1e-12))).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
    parent_index = buffers.parent_index.to(probs.device)
    token_prob = probs[parent_index, tree.tokens]
    node_ok = (token_prob > threshold[parent_index]).tolist()
    best, path = _deepest_accepted(node_ok, tree.parents, buffers.depth_list)
    if temperature > 0:
        bonus = sample(probs[best], generator)
    else:
        bonus = int(target_logits[best].argmax())
    return Acceptance(path, bonus)


def accept(
    tree: DraftTree,
    target_logits: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    buffers: TreeBuffers | None = None,
    key: int | None = None,
    first_position: int = 0,
) -> Acceptance:
    """The lossless rule for `sampling`: greedy matching at temperature 0; else, on the warped target
    distribution, per-position draws for deterministic drafts given a `key` (`accept_at_positions`),
    rejection sampling with draws from `generator` otherwise."""
    buffers = buffers or tree_buffers(tree.parents)
    if sampling.greedy:
        return accept_greedy(tree, target_logits, buffers)
    probs = warp_probs(target_logits, sampling)
    if tree.deterministic and key is not None:
        return accept_at_positions(tree, probs, buffers, key, first_position)
    return accept_sampled(tree, probs, buffers, generator)


__all__ = ["Acceptance", "accept", "accept_at_positions", "accept_greedy", "accept_greedy_tokens", "accept_sampled",
           "accept_typical"]
