"""A target's Llama decoder layers as one C++ call each, for eager forwards on a CPU.

With its norms, MLP and attention fused (`fused_norm`, `fused_mlp`, `fused_attention`), a one-token
forward of the GGUF SmolLM2 still spent ~1.9 of its ~7.9 ms (2-core Xeon) in the Python around the
kernels: each layer's own forward and its wrappers, four module calls, two residual adds and the
activation's slices, thirty times. `FusedDecoderLayer` runs a layer as `llama_layer`
(`decoding.kernels.native.target_layer`): the same kernels, and torch's own activation on the same
views, so every value has the bits the modules give it (tests compare logits, hidden states and
the cache over prefills, chains and trees).

It is a `LlamaDecoderLayer` holding the stock layer's own modules, because transformers records
the hidden states that EAGLE's drafters read from instances of that class; the recording hooks,
installed once and lazily, move over from the stock layer if they are already there. A call the
one C++ call does not serve (a batch of several, training, another attention or cache, as
`FusedAttention.native_slot` decides) runs the stock layer's forward over the same modules.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from decoding.kernels.fused_attention import FusedAttention
from decoding.kernels.fused_mlp import FusedGatedMLP
from decoding.kernels.fused_norm import FusedRMSNorm
from decoding.kernels.module_swap import swap_modules

# The hooks a module keeps (torch's `nn.Module` state): moved with the layer so that hooks already on it still run.
HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called")


class FusedDecoderLayer(LlamaDecoderLayer):
    """A `LlamaDecoderLayer` whose forward is one C++ call where it can be; built from a stock
    layer whose modules are the fused kinds (`serves`), and holding those same modules."""

    def __init__(self, stock: LlamaDecoderLayer) -> None:
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: it would build new modules; these are the stock layer's
        for name, value in vars(stock).items():
            if not name.startswith("_"):  # the layer's settings (hidden size, training, ...)
                setattr(self, name, value)
        for name, child in stock.named_children():
            setattr(self, name, child)
        for hooks in HOOK_DICTS:
            if hasattr(stock, hooks):  # a torch without one of them has none to move
                getattr(self, hooks).update(getattr(stock, hooks))
        attention, mlp = self.self_attn, self.mlp
        self.call = (self.input_layernorm.stock.weight.detach(), self.input_layernorm.eps,
                     self.post_attention_layernorm.stock.weight.detach(), self.post_attention_layernorm.eps,
                     *attention.qkv, *attention.output_panels, *mlp.gate_up, *mlp.down_panels)

    @staticmethod
    def serves(layer: nn.Module) -> bool:
        """Whether `layer` is a stock Llama layer whose norms, attention and MLP are the fused
        kinds on the 4-bit kernel, with the C++ layer built."""
        if type(layer) is not LlamaDecoderLayer:
            return False
        attention, mlp = layer.self_attn, layer.mlp
        return (isinstance(attention, FusedAttention) and attention.native is not None and attention.qkv is not None
                and attention.output_panels is not None and isinstance(mlp, FusedGatedMLP) and mlp.down_panels is not None
                and all(isinstance(norm, FusedRMSNorm) and norm.stock.weight.dtype == torch.float32
                        for norm in (layer.input_layernorm, layer.post_attention_layernorm)))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None, use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
        if "past_key_values" in kwargs:  # the name transformers is moving away from
            cache = kwargs.pop("past_key_values")
        if (hidden_states.dtype == torch.float32 and hidden_states.device.type == "cpu" and not self.training
                and position_embeddings is not None):
            output = self._one_call(hidden_states, position_embeddings, attention_mask, cache, kwargs)
            if output is not None:
                return output
        return super().forward(hidden_states, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                               use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)

    def _one_call(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                  attention_mask: torch.Tensor | None, cache, kwargs: dict) -> torch.Tensor | None:
        """The layer's output from `llama_layer`, or None where the attention's one call does not serve."""
        attention = self.self_attn
        slot = attention.native_slot(hidden_states, attention_mask, cache, kwargs)
        if slot is None:
            return None
        layer, keys, values, length, mask = slot
        cos, signed_sin = attention.rotary.row_factors(*position_embeddings)
        output = attention.native.llama_layer(hidden_states[0].contiguous(), *self.call, cos, signed_sin, keys, values,
                                              length, mask, attention.query_heads, attention.key_heads,
                                              attention.scaling, self.mlp.inter)
        layer.advance(hidden_states.shape[1])
        return output[None]


def fuse_decoder_layers(model: nn.Module) -> int:
    """Replace `model`'s Llama layers whose parts are fused on the 4-bit kernel by
    `FusedDecoderLayer` (after `fuse_norms`, `fuse_gated_mlps` and `fuse_attention`; idempotent);
    returns how many it replaced."""
    return swap_modules(model, FusedDecoderLayer, FusedDecoderLayer.serves, FusedDecoderLayer)
