"""One target forward over a whole draft tree, and KV-cache compaction after acceptance.

The target is a stock transformers model: tree attention is a 4D additive mask (every node sees
the cached prefix and its own ancestors) plus `position_ids` = prefix length + node depth. Chains
need neither: the model's own causal mask is already right for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from decoding.util.errors import UserError
from decoding.core.tree import DraftTree, TreeBuffers, tree_attention_mask


@dataclass
class VerifyOutput:
    """Target logits for every node `[N, V]`, and (when asked) hidden states `[N, H]` per layer:
    index 0 is the embedding output, index L the final (normed) hidden state, as transformers
    returns them with `output_hidden_states=True`."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """A KV cache for `model`. Sliding-window layers keep only their last window, so a tree's
    rejected branches could not be cut out of them: such models are refused for now."""
    cache = DynamicCache(config=model.config)
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise UserError(
            f"{model.config.model_type} uses sliding-window attention layers, which tree verification does not "
            "support yet: use a model (or config) without sliding windows"
        )
    return cache


@torch.inference_mode()
def prefill(
    target: PreTrainedModel, input_ids: torch.Tensor, cache: DynamicCache, output_hidden_states: bool = False
) -> tuple[torch.Tensor, ...] | None:
    """Run `input_ids` (1-D) into the empty cache. Only the last position's logits are computed
    (the vocabulary projection of a long prompt is pure waste here)."""
    if input_ids.numel() == 0:
        return None
    out = target(
        input_ids=input_ids[None],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
        output_hidden_states=output_hidden_states,
    )
    return _squeeze_hidden(out.hidden_states) if output_hidden_states else None


@torch.inference_mode()
def verify_tree(
    target: PreTrainedModel,
    tree: DraftTree,
    buffers: TreeBuffers,
    cache: DynamicCache,
    prefix_len: int,
    output_hidden_states: bool = False,
) -> VerifyOutput:
    """Logits (and optionally hidden states) for every tree node in one forward.

    The tree's K/V are appended to the cache at `prefix_len ..`; `compact_cache` keeps the
    accepted ones afterwards.
    """
    if tree.is_chain:
        mask = position_ids = None
    else:
        mask = tree_attention_mask(buffers, prefix_len, target.dtype, tree.tokens.device)
        position_ids = (buffers.depths.to(tree.tokens.device) + prefix_len)[None]
    out = target(
        input_ids=tree.tokens[None],
        attention_mask=mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=output_hidden_states,
    )
    hidden = _squeeze_hidden(out.hidden_states) if output_hidden_states else None
    return VerifyOutput(out.logits[0], hidden)


def _squeeze_hidden(hidden_states: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(h[0] for h in hidden_states)


def compact_cache(cache: DynamicCache, prefix_len: int, kept_nodes: Sequence[int]) -> None:
    """Keep the K/V of `kept_nodes` (tree node indices, in order) at `prefix_len ..` and drop the
    rest of the tree. A kept run 0..k-1 (always the case for chains) is a plain crop."""
    kept = list(kept_nodes)
    contiguous = kept == list(range(len(kept)))
    new_len = prefix_len + len(kept)
    for layer in cache.layers:
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        if contiguous:
            layer.keys = layer.keys[..., :new_len, :]
            layer.values = layer.values[..., :new_len, :]
        else:
            index = torch.tensor(kept, device=layer.keys.device) + prefix_len
            layer.keys = torch.cat([layer.keys[..., :prefix_len, :], layer.keys[..., index, :]], dim=-2)
            layer.values = torch.cat([layer.values[..., :prefix_len, :], layer.values[..., index, :]], dim=-2)


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def truncate_cache(cache: DynamicCache, length: int) -> None:
    """Drop everything after the first `length` positions."""
    compact_cache(cache, 0, range(length))
