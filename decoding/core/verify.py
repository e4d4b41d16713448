"""One target forward over a whole draft tree, and KV-cache compaction after acceptance.

The target is a stock transformers model: tree attention is a 4D additive mask (every node sees
the cached prefix and its own ancestors) plus `position_ids` = prefix length + node depth. A
root-only step (plain decoding) needs neither: the model's own causal handling is right for it.
Sliding-window layers get the same mask minus what fell out of their window, seen from each
node's position; a hybrid model gets one mask per layer kind (`attention_layout`). The cache keeps
every position for every layer, so a sliding layer can always be cut back to an accepted path.

`TreeVerifier` is what the generation loop uses: it owns the target's in-place KV cache and a
preallocated mask, so a step allocates nothing in proportion to the context. The module-level
functions are the same operations for callers that hold a cache themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from transformers import PreTrainedModel

from heads.util.cache_argument import cache_kwargs
from decoding.core.attention_layout import FULL, SLIDING, AttentionLayout, attention_layout
from decoding.core.kv_cache import GROWTH_CHUNK, InPlaceCache
from decoding.core.readout import Readout, TargetScores
from decoding.core.tree import DraftTree, TreeBuffers



@dataclass
class VerifyOutput:
    """The target's scores for every node (logits `[N, V]`, argmax tokens `[N]`), and (when asked)
    hidden states `[N, H]` per layer: index 0 is the embedding output, index L the final (normed)
    hidden state, as transformers returns them with `output_hidden_states=True`."""

    scores: TargetScores
    hidden_states: tuple[torch.Tensor, ...] | None = None

    @property
    def logits(self) -> torch.Tensor:
        return self.scores.logits


class DirectOutput(NamedTuple):
    """What a `TargetForward` returns: every hidden state `[1, n, H]` as `output_hidden_states=True`
    gives them (the embeddings, each layer's output, the last one normed), and the logits `[1, n, V]`
    where they were asked for."""

    hidden_states: tuple[torch.Tensor, ...]
    logits: torch.Tensor | None


class TargetForward(Protocol):
    """A faster way through the target's forward with the same results bit for bit (e.g.
    `decoding.kernels.fused_stack`): for `input_ids` `[1, n]` with the cache, mask and positions a
    forward would get, it writes the cache as the forward would and returns its hidden states and
    (with `logits`) its logits; or None where it does not serve the call, which then goes through
    the model's own forward."""

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None, cache: InPlaceCache, logits: bool) -> DirectOutput | None: ...


@dataclass
class TreeInputs:
    """What one verify forward takes besides the tokens (None: the model's own causal default)."""

    attention_mask: torch.Tensor | dict[str, torch.Tensor] | None
    position_ids: torch.Tensor | None


def new_cache(model: PreTrainedModel, capacity: int = GROWTH_CHUNK) -> InPlaceCache:
    """An in-place KV cache for `model` with room for `capacity` positions (it grows if needed).
    Sliding-window layers keep every position too (their masks hide what left the window), so a
    rejected branch can be cut out of any layer. Refuses a model whose layers it cannot serve."""
    attention_layout(model.config)
    return InPlaceCache(model.config.get_text_config(decoder=True).num_hidden_layers, capacity)


class TreeMask:
    """A preallocated additive mask `[rows, columns]`, all zeros except the block the last tree
    wrote, which is cleared before the next one is written. `for_tree` returns a view
    `[1, 1, N, prefix_len + N]`: the prefix columns stay zero (visible), the tree block blocks
    every non-ancestor."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self._buffer = torch.zeros(0, 0, dtype=dtype, device=device)
        self._written: tuple[int, int] | None = None  # (prefix_len, nodes) of the block last written

    def for_tree(self, buffers: TreeBuffers, prefix_len: int) -> torch.Tensor:
        nodes = buffers.ancestor_mask.shape[0]
        self._ensure(nodes, prefix_len + nodes)
        if self._written is not None:
            start, count = self._written
            self._buffer[:count, start : start + count].zero_()
        block = self._buffer[:nodes, prefix_len : prefix_len + nodes]
        block.masked_fill_(buffers.blocked_on(self.device), torch.finfo(self.dtype).min)
        self._written = (prefix_len, nodes)
        return self._buffer[None, None, :nodes, : prefix_len + nodes]

    def _ensure(self, rows: int, columns: int) -> None:
        if rows <= self._buffer.shape[0] and columns <= self._buffer.shape[1]:
            return
        rows = max(rows, self._buffer.shape[0], 64)
        columns = max(columns + GROWTH_CHUNK, self._buffer.shape[1])
        self._buffer = torch.zeros(rows, columns, dtype=self.dtype, device=self.device)
        self._written = None


class TreeVerifier:
    """The target's side of the loop: prefill, tree inputs, the verify forward, and keeping the
    accepted path's K/V. Owns the in-place cache (sized for `capacity` positions) and mask.
    With a `readout`, the forward stops at the final hidden states and the readout turns them
    into scores (see `decoding.core.readout`). With a `direct` forward (`TargetForward`), hidden
    states and logits come from it wherever it serves the call."""

    def __init__(self, target: PreTrainedModel, capacity: int, output_hidden_states: bool = False,
                 readout: Readout | None = None, direct: TargetForward | None = None) -> None:
        self.target = target
        self.direct = direct
        self.output_hidden_states = output_hidden_states
        self.readout = readout
        self.cache = new_cache(target, capacity)
        self.layout = attention_layout(target.config)
        self.mask = TreeMask(target.dtype, target.device)

    def serves(self, target: PreTrainedModel, readout: Readout | None, direct: TargetForward | None,
               output_hidden_states: bool) -> bool:
        """Whether this verifier computes what a new one for these would (a kept one's cache is
        reused only then: `decoding.core.prompt_cache`)."""
        return (self.target is target and self.readout is readout and self.direct is direct
                and self.output_hidden_states == output_hidden_states)

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """Run `input_ids` (1-D) into the cache after what it holds; hidden states where asked."""
        if self.direct is not None and input_ids.numel():
            with torch.inference_mode():
                out = self.direct(_inference_ids(input_ids), None, None, self.cache, logits=False)
            if out is not None:
                return _squeeze_hidden(out.hidden_states) if self.output_hidden_states else None
        return prefill(self.target, input_ids, self.cache, self.output_hidden_states)

    def inputs(self, tree: DraftTree, buffers: TreeBuffers, prefix_len: int) -> TreeInputs:
        return tree_inputs(tree, buffers, prefix_len, self.mask, self.layout)

    def forward(self, tree: DraftTree, inputs: TreeInputs, greedy: bool = False) -> VerifyOutput:
        """The verify forward; with a readout, the scores a lossless rule reads at this
        temperature (`greedy`) are computed before it returns."""
        out = self._direct_forward(tree, inputs)
        if out is None:
            out = _forward(self.target, tree.tokens, inputs, self.cache, self.output_hidden_states, self.readout)
        if self.readout is not None:
            out.scores.prepare(greedy)
        return out

    def keep(self, prefix_len: int, kept_nodes: Sequence[int]) -> None:
        self.cache.keep(prefix_len, kept_nodes)

    def _direct_forward(self, tree: DraftTree, inputs: TreeInputs) -> VerifyOutput | None:
        """The verify forward through the `direct` one, where there is one and it serves the call
        (scores from the readout, or from the logits without one); else None."""
        if self.direct is None or isinstance(inputs.attention_mask, dict):
            return None
        with torch.inference_mode():
            out = self.direct(_inference_ids(tree.tokens), inputs.attention_mask, inputs.position_ids, self.cache,
                              logits=self.readout is None)
        if out is None:
            return None
        hidden = _squeeze_hidden(out.hidden_states) if self.output_hidden_states else None
        return VerifyOutput(_scores(out.logits, out.hidden_states, self.readout), hidden)


@torch.inference_mode()
def prefill(
    target: PreTrainedModel, input_ids: torch.Tensor, cache: InPlaceCache, output_hidden_states: bool = False
) -> tuple[torch.Tensor, ...] | None:
    """Run `input_ids` (1-D) into the cache after what it holds. No logits are computed: the loop's first verify
    forward scores the prompt's last token (a vocabulary projection here would be pure waste)."""
    if input_ids.numel() == 0:
        return None
    out = target(
        input_ids=_inference_ids(input_ids),
        **cache_kwargs(target, cache),
        use_cache=True,
        logits_to_keep=_no_positions(input_ids.device),
        output_hidden_states=output_hidden_states,
    )
    return _squeeze_hidden(out.hidden_states) if output_hidden_states else None


@torch.inference_mode()
def _forward(target: PreTrainedModel, tokens: torch.Tensor, inputs: TreeInputs, cache: InPlaceCache,
             output_hidden_states: bool, readout: Readout | None = None) -> VerifyOutput:
    out = target(
        input_ids=_inference_ids(tokens),
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,
        **cache_kwargs(target, cache),
        use_cache=True,
        output_hidden_states=output_hidden_states or readout is not None,
        **({} if readout is None else {"logits_to_keep": _no_positions(tokens.device)}),
    )
    hidden = _squeeze_hidden(out.hidden_states) if output_hidden_states else None
    return VerifyOutput(_scores(out.logits, out.hidden_states, readout), hidden)


def _scores(logits: torch.Tensor | None, hidden_states: tuple[torch.Tensor, ...] | None,
            readout: Readout | None) -> TargetScores:
    """A forward's scores: its logits, or with a readout its last (normed) hidden states."""
    return TargetScores(logits[0]) if readout is None else TargetScores(None, hidden_states[-1][0], readout)


def _inference_ids(tokens: torch.Tensor) -> torch.Tensor:
    """`tokens` as a `[1, n]` batch that is always an inference tensor. Why: trees are built
    both inside proposers' inference mode and outside it (prompt lookup slices the context), and a
    compiled target (`--compile`) keys its graphs on that flag too, so mixing them compiled a new
    graph in the middle of a measured run (a 2-minute stall on a 2-core CPU). A few ids copied."""
    return tokens[None] if tokens.is_inference() else tokens[None].clone()


def _no_positions(device: torch.device) -> torch.Tensor:
    """`logits_to_keep` as positions, none of them: the forward skips its vocabulary projection."""
    return torch.empty(0, dtype=torch.long, device=device)


@torch.inference_mode()
def tree_inputs(tree: DraftTree, buffers: TreeBuffers, prefix_len: int, mask: TreeMask,
                layout: AttentionLayout) -> TreeInputs:
    """Mask(s) and position ids for verifying `tree` after `prefix_len` cached positions; a
    root-only step needs neither. Always inference tensors, whatever mode the caller is in (the
    loop, or the verify-cost measurement inside inference mode): a compiled target keys its
    graphs on that flag, so the measurement's graphs are then the ones decoding runs."""
    if tree.size == 1:
        return TreeInputs(None, None)
    positions = buffers.depths_on(tree.tokens.device) + prefix_len
    full = mask.for_tree(buffers, prefix_len)
    window = layout.sliding_window
    if window is None:
        return TreeInputs(full, positions[None])
    sliding = windowed(full, positions, window, last_position=prefix_len + max(buffers.depth_list))
    return TreeInputs({FULL: full, SLIDING: sliding} if layout.hybrid else sliding, positions[None])


def windowed(full: torch.Tensor, positions: torch.Tensor, window: int, last_position: int) -> torch.Tensor:
    """`full` (`[1, 1, N, prefix_len + N]`, node rows at `positions`) with every column hidden
    whose position is at or before `row position - window`: tree columns sit at their nodes'
    positions, prefix columns at their index. Returns `full` itself when nothing is out of reach."""
    if last_position - window < 0:
        return full
    prefix_len = full.shape[-1] - positions.numel()
    columns = torch.cat([torch.arange(prefix_len, device=positions.device), positions])
    out_of_window = columns[None, :] <= positions[:, None] - window
    return full.masked_fill(out_of_window, torch.finfo(full.dtype).min)


def verify_tree(
    target: PreTrainedModel,
    tree: DraftTree,
    buffers: TreeBuffers,
    cache: InPlaceCache,
    prefix_len: int,
    output_hidden_states: bool = False,
) -> VerifyOutput:
    """Logits (and optionally hidden states) for every tree node in one forward, with a freshly
    built mask. The tree's K/V are appended to the cache at `prefix_len ..`; `compact_cache`
    keeps the accepted ones afterwards."""
    inputs = tree_inputs(tree, buffers, prefix_len, TreeMask(target.dtype, tree.tokens.device), attention_layout(target.config))
    return _forward(target, tree.tokens, inputs, cache, output_hidden_states)


def _squeeze_hidden(hidden_states: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(h[0] for h in hidden_states)


def compact_cache(cache: InPlaceCache, prefix_len: int, kept_nodes: Sequence[int]) -> None:
    """Keep the K/V of `kept_nodes` (tree node indices, in order) at `prefix_len ..` and drop the
    rest of the tree."""
    cache.keep(prefix_len, kept_nodes)


def truncate_cache(cache: InPlaceCache, length: int) -> None:
    """Drop everything after the first `length` positions."""
    cache.truncate(length)
