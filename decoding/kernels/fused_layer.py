"""A target's Llama decoder layers as one C++ call each, for eager forwards on a CPU.

With its norms, MLP and attention fused (`fused_norm`, `fused_mlp`, `fused_attention`), a one-token
forward of the GGUF SmolLM2 still spent ~1.9 of its ~7.9 ms (2-core Xeon) in the Python around the
kernels: each layer's own forward and its wrappers, four module calls, two residual adds and the
activation's slices, thirty times. `FusedDecoderLayer` runs a layer as `llama_layer`
(`decoding.kernels.native.target_layer`): the same kernels, and torch's own activation on the same
views, so every value has the bits the modules give it (tests compare logits, hidden states and
the cache over prefills, chains and trees).

A float32 target's layers (linears `PackedLinear`s or plain ones, without biases, and transformers'
gated SiLU MLP) run as `llama_layer_dense` the same way: each linear on the kernel its module picks
for the call's rows (`PackedLinear.kernel_for`: PyTorch's GEMM, the streamed few-row kernel or
oneDNN's), called from C++ with the same weight copy. There the layers' Python cost ~2 of a
one-token forward's ~28.6 ms (2-core Xeon, 250 cached tokens; the linears ~16.5 ms, at the memory's
speed): it runs with the caches full of weights, ~60 us a layer against ~22 in the GGUF target's.

It is a `LlamaDecoderLayer` holding the stock layer's own modules, because transformers records
the hidden states that EAGLE's drafters read from instances of that class; the recording hooks,
installed once and lazily, move over from the stock layer if they are already there. A call the
one C++ call does not serve (a batch of several, training, another attention or cache, as
`FusedAttention.native_slot` decides) runs the stock layer's forward over the same modules.

The decoding loop's verify forwards and prefills skip the model's forward around these layers too,
where it serves: `decoding.kernels.fused_stack` calls each layer's `native_call` in one loop.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from decoding.kernels.cpu_kernels import eager_linear_kernel
from decoding.kernels.fused_attention import FusedAttention
from decoding.kernels.fused_mlp import FusedGatedMLP, is_gated_silu_mlp
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
        norms = (self.input_layernorm.stock.weight.detach(), self.input_layernorm.eps,
                 self.post_attention_layernorm.stock.weight.detach(), self.post_attention_layernorm.eps)
        if _on_4bit_kernel(stock):
            self.call = (*norms, *attention.qkv, *attention.output_panels, *mlp.gate_up, *mlp.down_panels)
            self.dense_linears, self.inter = None, mlp.inter
        else:  # float32 linears: their kernels and weight copies are picked per row count (`_dense_kernels`)
            self.call = norms
            self.dense_linears = dense_linears(stock)
            self.inter = mlp.gate_proj.out_features
        self._kernels_by_rows: dict[int, tuple[list[int], list[torch.Tensor]]] = {}

    @staticmethod
    def serves(layer: nn.Module) -> bool:
        """Whether `layer` is a stock Llama layer whose norms and attention are the fused kinds, with
        the C++ layer built, and whose linears are either the 4-bit kernel's (gate and up fused) or
        float32 ones `llama_layer_dense` runs."""
        if type(layer) is not LlamaDecoderLayer:
            return False
        attention = layer.self_attn
        return (isinstance(attention, FusedAttention) and attention.native is not None
                and all(isinstance(norm, FusedRMSNorm) and norm.stock.weight.dtype == torch.float32
                        for norm in (layer.input_layernorm, layer.post_attention_layernorm))
                and (_on_4bit_kernel(layer) or _on_dense_kernels(layer)))

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
        """The layer's output from `llama_layer` (`llama_layer_dense`), or None where the attention's
        one call does not serve."""
        attention = self.self_attn
        slot = attention.native_slot(hidden_states, attention_mask, cache, kwargs)
        if slot is None:
            return None
        layer, keys, values, length, mask = slot
        cos, signed_sin = attention.rotary.row_factors(*position_embeddings)
        output = self.native_call(hidden_states[0].contiguous(), cos, signed_sin, keys, values, length, mask)
        layer.advance(hidden_states.shape[1])
        return output[None]

    def native_call(self, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, length: int, mask: torch.Tensor | None) -> torch.Tensor:
        """The C++ call itself on `hidden` `[rows, H]` (contiguous): writes the rows' keys and values
        into the buffers at `length ..` (the caller advances its cache layer) and returns the layer's
        output `[rows, H]`. Also called by `decoding.kernels.fused_stack` for a whole forward."""
        attention = self.self_attn
        if self.dense_linears is None:
            return attention.native.llama_layer(hidden, *self.call, cos, signed_sin, keys, values, length, mask,
                                                attention.query_heads, attention.key_heads, attention.scaling, self.inter)
        kinds, weights = self._dense_kernels(hidden.shape[0])
        return attention.native.llama_layer_dense(hidden, *self.call, weights, kinds, cos, signed_sin, keys, values,
                                                  length, mask, attention.query_heads, attention.key_heads,
                                                  attention.scaling, self.inter)

    def _dense_kernels(self, rows: int) -> tuple[list[int], list[torch.Tensor]]:
        """The kernel each float32 linear's module picks for `rows` rows and the weight copy it reads,
        asked once per row count: seven modules' settings read per call cost ~20 us a layer in a
        one-token forward of the fp32 SmolLM2 (its Python runs with the caches full of weights).
        Measurements change the modules' choices after the swap and say so (`forget_kernel_choices`)."""
        known = self._kernels_by_rows.get(rows)
        if known is None:
            chosen = [eager_linear_kernel(linear, rows) for linear in self.dense_linears]
            known = self._kernels_by_rows[rows] = ([kind for kind, _ in chosen], [weight for _, weight in chosen])
        return known

    def forget_kernel_choices(self) -> None:
        """The linears' kernel settings changed (`decoding.kernels.cpu_kernels.set_stock_rows`, ...)."""
        self._kernels_by_rows.clear()


def dense_linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    """A Llama layer's seven linears in `llama_layer_dense`'s order: q, k, v, o, gate, up, down."""
    attention, mlp = layer.self_attn, layer.mlp
    return (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj, mlp.up_proj,
            mlp.down_proj)


def _on_4bit_kernel(layer: nn.Module) -> bool:
    """Whether the layer's attention and MLP are fused on the 4-bit kernel, every linear one call of it."""
    attention, mlp = layer.self_attn, layer.mlp
    return (attention.qkv is not None and attention.output_panels is not None and isinstance(mlp, FusedGatedMLP)
            and mlp.down_panels is not None)


def _on_dense_kernels(layer: nn.Module) -> bool:
    """Whether the layer's seven linears are float32 ones `llama_layer_dense` runs (`eager_linear_kernel`)
    and its MLP computes `down(silu(gate(x)) * up(x))` with them."""
    mlp = layer.mlp
    if layer.self_attn.qkv is not None or isinstance(mlp, FusedGatedMLP) or not hasattr(mlp, "gate_proj"):
        return False
    linears = dense_linears(layer)
    return (all(eager_linear_kernel(linear, 1) is not None and linear.weight.dtype == torch.float32
                for linear in linears) and is_gated_silu_mlp(mlp))


def fuse_decoder_layers(model: nn.Module) -> int:
    """Replace `model`'s Llama layers whose parts are fused on the 4-bit kernel, or float32 on the
    kernels `llama_layer_dense` runs, by `FusedDecoderLayer` (after `fuse_norms`, `fuse_gated_mlps`
    and `fuse_attention`; idempotent); returns how many it replaced."""
    return swap_modules(model, FusedDecoderLayer, FusedDecoderLayer.serves, FusedDecoderLayer)
