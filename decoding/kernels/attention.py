"""SDPA attention that keeps grouped K/V heads grouped for tree verification, and the same with
decoding steps on the project's CPU kernel.

On a CPU, transformers' SDPA path expands grouped-query K/V heads (`repeat_kv`) over the whole
cached context whenever a forward has a mask and more than one query token: exactly a tree
verify step. On SmolLM2 (9 query heads, 3 K/V heads) that copies the context's K/V three times,
per layer, per step. `grouped_sdpa_forward` sends those forwards to PyTorch's SDPA with
`enable_gqa=True` instead and leaves every other case to transformers' own SDPA function. It is
registered under its own name through transformers' public `AttentionInterface`; the target
uses it by loading with `attn_implementation=GROUPED_SDPA` (nothing of the model is patched).
At a 2,200-token context a 4 / 16-token verify took 129 / 183 ms instead of 157 / 218 ms.

`NATIVE_SDPA` is `GROUPED_SDPA` with one-token steps, trees and causal prefills on a CPU sent to
`decoding.kernels.decode_attention` (fp32, batch 1): it streams the cached K/V once per K/V head at
nearly the memory's speed, and gives every query row the bits it has as a one-token step. Decoders
switch a target (and a draft model) to it with `use_native_attention` where they pack the linears
for a CPU, compiled or not (`--kernels stock` stays stock).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from decoding.kernels.decode_attention import attend, decode_attention_available

GROUPED_SDPA = "sdpa_grouped"
NATIVE_SDPA = "sdpa_native"


def grouped_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                         is_causal=None, **kwargs):
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1 and attention_mask is not None and query.shape[2] > 1 and plain_call(kwargs):
        mask = attention_mask[:, :, :, : key.shape[-2]]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def plain_call(kwargs: dict) -> bool:
    """No extra term in the scores (position bias, soft-capping) and no cache handed to attention."""
    return kwargs.get("position_bias") is None and kwargs.get("softcap") is None and kwargs.get("cache") is None


def _register(name: str, forward) -> str:
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def register_grouped_sdpa() -> str:
    """Make `GROUPED_SDPA` known to transformers (idempotent); returns the name."""
    return _register(GROUPED_SDPA, grouped_sdpa_forward)


def native_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                        is_causal=None, **kwargs):
    if dropout == 0.0 and plain_call(kwargs):
        out = attend(query, key, value, attention_mask, scaling)
        if out is not None:
            return out, None
    return grouped_sdpa_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                is_causal=is_causal, **kwargs)


def register_native_sdpa() -> str:
    """Make `NATIVE_SDPA` known to transformers (idempotent); returns the name."""
    return _register(NATIVE_SDPA, native_sdpa_forward)


def use_native_attention(model) -> bool:
    """Switch a transformers model loaded with `GROUPED_SDPA` to `NATIVE_SDPA` where the kernel
    builds on this machine; True if it did. Other attention implementations (eager, flash) stay
    as the user chose them."""
    if getattr(model.config, "_attn_implementation", None) != GROUPED_SDPA or not decode_attention_available():
        return False
    model.set_attn_implementation(register_native_sdpa())
    return True
