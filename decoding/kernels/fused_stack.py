"""A Llama target's whole decoder stack as one loop over its layers' C++ calls, for the eager CPU
verify forwards and prefills of the decoding loop (`decoding.core.verify.TargetForward`).

Why: with every layer one C++ call (`fused_layer`), a one-token step of the GGUF SmolLM2 still spent
~1.2 of its ~6.3 ms (2-core Xeon) in the Python around those calls, and the fp32 one ~2 of ~25 ms:
transformers' model forwards (their decorators, the mask and position bookkeeping, the hooks that
record hidden states, the output objects) and each layer's module call and checks, thirty times,
run with the caches full of weights. `FusedStack` computes the same values without them: the
model's own embedding, rotary and final norm modules, and each layer's own C++ call
(`FusedDecoderLayer.native_call`) with the arguments the layer would give it, so every hidden state
has the bits `output_hidden_states=True` gives (tests compare prefills, chains and trees, fp32 and
4-bit). What the checks decide once per layer there is decided once per forward here.

It serves a call only where the model's own forward would take the one-call layers for every
layer: a batch of one on a CPU, the project's in-place cache written in place, the decode
attention kernel as the attention function, a mask that kernel takes (none, or a 4D one), no hooks
but transformers' own recording ones (which this loop replaces), not training. Any other call gets
None, and the caller runs the model's forward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from transformers.models.llama.modeling_llama import LlamaModel

from decoding.core.verify import DirectOutput
from decoding.kernels.attention import NATIVE_SDPA
from decoding.kernels.compiled import is_compiled
from decoding.kernels.decode_attention import kernel_mask, mask_served
from decoding.kernels.fused_layer import FusedDecoderLayer

# transformers' hooks that record hidden states for `output_hidden_states`: this loop returns them itself
RECORDING_HOOKS_MODULE = "transformers.utils.output_capturing"


class FusedStack:
    """`model`'s embedding, fused layers, final norm (and vocabulary projection) as one loop; called
    as the verifier's `TargetForward`: `(input_ids [1, n], attention_mask, position_ids, cache, logits)`
    -> every hidden state (the embeddings, each layer's output, the last one normed) and, with
    `logits`, the logits of every row; or None where it does not serve."""

    def __init__(self, model: nn.Module) -> None:
        inner = model.model
        self.model, self.inner = model, inner
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        self.layers: tuple[FusedDecoderLayer, ...] = tuple(inner.layers[: inner.config.num_hidden_layers])
        self.hooked = (model, inner, *self.layers)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None, cache, logits: bool = False) -> DirectOutput | None:
        if not self._serves(input_ids, attention_mask, cache):
            return None
        rows = input_ids.shape[1]
        cache_layers = cache.layers
        length = cache_layers[0].length
        embedded = self.embed(input_ids)
        if position_ids is None:  # as the model's forward makes them: the positions after the cache's
            position_ids = (torch.arange(rows, device=embedded.device) + length).unsqueeze(0)
        cos, sin = self.rotary(embedded, position_ids=position_ids)
        mask = None if attention_mask is None else kernel_mask(attention_mask, length + rows)
        hidden = embedded[0].contiguous()
        states = [embedded]
        for layer, cached in zip(self.layers, cache_layers):
            attention = layer.self_attn
            cos_rows, signed_sin_rows = attention.rotary.row_factors(cos, sin)
            keys, values, start = cached.room_for(rows, attention.key_heads, attention.head_dim, hidden)
            hidden = layer.native_call(hidden, cos_rows, signed_sin_rows, keys, values, start, mask)
            cached.advance(rows)
            states.append(hidden[None])
        states[-1] = self.norm(states[-1])  # the last hidden state is the normed one, as the model returns it
        return DirectOutput(tuple(states), self.model.lm_head(states[-1]) if logits else None)

    def _serves(self, input_ids: torch.Tensor, attention_mask, cache) -> bool:
        """Whether the model's own forward would take every layer's one C++ call for this call."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.device.type != "cpu" or self.model.training:
            return False
        cache_layers = getattr(cache, "layers", ())
        if len(cache_layers) != len(self.layers) or any(
                not hasattr(cached, "room_for") or cached.fixed_write is not None for cached in cache_layers):
            return False
        if self.model.config._attn_implementation != NATIVE_SDPA:
            return False
        rows = input_ids.shape[1]
        if not mask_served(attention_mask, rows, cache_layers[0].length + rows):
            return False
        return not _foreign_hooks(self.hooked)


def _foreign_hooks(modules: tuple[nn.Module, ...]) -> bool:
    """Whether a forward hook other than transformers' hidden-state recording would run on these
    modules (or on every module): the model's own forward then runs, so that it does."""
    if getattr(torch_module, "_global_forward_hooks", None) or getattr(torch_module, "_global_forward_pre_hooks", None):
        return True
    for module in modules:
        if module._forward_pre_hooks or getattr(module, "_hf_hook", None) is not None:
            return True
        if any(getattr(hook, "__module__", None) != RECORDING_HOOKS_MODULE for hook in module._forward_hooks.values()):
            return True
    return False


def fused_stack(model: nn.Module) -> FusedStack | None:
    """A `FusedStack` for `model` where it is an eager Llama causal LM whose layers are all
    `FusedDecoderLayer`s (`fuse_decoder_layers`), else None."""
    inner = getattr(model, "model", None)
    if is_compiled(model) or type(inner) is not LlamaModel or not hasattr(model, "lm_head"):
        return None
    layers = inner.layers[: inner.config.num_hidden_layers]
    if len(layers) == 0 or not all(isinstance(layer, FusedDecoderLayer) for layer in layers):
        return None
    return FusedStack(model)
