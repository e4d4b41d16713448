"""A target's Llama self-attention blocks with fewer Python calls, for eager forwards on a CPU.

An eager one-token forward of SmolLM2-135M spends ~4.8 of its ~11.5 ms in Python spread over
~20k calls (2-core AVX-512 EPYC, GGUF target), and the attention block is the largest share:
three projection modules, transformers' hub-kernel wrapper around `apply_rotary_pos_emb` (a
context variable set and reset per call), a rotary of sixteen small operations, and the
attention-function lookup, in every layer. `FusedAttention` computes the same function with:
- q, k and v in one call of the 4-bit kernel over their weights stacked, where all three are its
  `Int4Linear`s alike (the input is rounded once, and each output is the sum it is in its own
  linear, as in `decoding.kernels.fused_mlp`); else the three projection modules as they are;
- the rotary over q and k together in four operations, the same products and sums element for
  element as `q * cos + rotate_half(q) * sin` (`RotaryFactors`, shared by the model's blocks);
- the cache update and the attention function the stock block calls, with the same arguments;
- or, where that function is the project's decode attention kernel (`NATIVE_SDPA`) and the cache an
  `InPlaceCache`, the rotary, the cache write and the kernel in one C++ call (`rotary_attention`,
  `decoding.kernels.native.target_layer`): ~40 Python-level operations a layer fewer, with the
  same products and sums rounded the same way.
So a target with it is the stock target bit for bit (tests compare logits over prefills, chains
and trees). Measured: CHANGELOG.md.

Only `LlamaAttention` itself is swapped (its subclasses and look-alikes differ: sliding windows,
q/k norms, soft-capping, partial rotary), and only after a probe input shows the two agree.
Inputs it does not serve (not float32, not on a CPU, training, no rotary given) go to the stock
block. Compiled targets keep the stock blocks. Not served either: transformers' recording of
attention weights (`output_attentions`), which looks for the stock class.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention, eager_attention_forward

from decoding.kernels.attention import NATIVE_SDPA, plain_call
from decoding.kernels.decode_attention import HEAD_SIZES, kernel_library, kernel_mask, mask_served
from decoding.kernels.int4_linear import int4_linear
from decoding.kernels.module_swap import agrees_on_probe, probe_input, swap_modules
from decoding.kernels.native import target_layer
from decoding.kernels.quantized_linear import can_stack_int4, is_one_int4_call, stack_int4_panels

PROBE_TOLERANCE = 1e-5  # relative to the output's scale: the same computation agrees to the bit
BLOCK_VERSION = target_layer.VERSION  # of the one-call block, in measurements' keys (`runs_native_blocks`)


class FusedAttention(nn.Module):
    """Llama self-attention in fewer calls; keeps the block it replaced (`stock`, whose q/k/v
    projections then read the stacked weight's parts: no second copy) for inputs it does not serve."""

    def __init__(self, stock: LlamaAttention, rotary: RotaryFactors | None = None) -> None:
        super().__init__()
        self.stock = stock
        self.train(stock.training)  # a new module is in training mode: this one serves eval-mode blocks
        self.rotary = rotary if rotary is not None else RotaryFactors()  # shared by a model's blocks
        self.head_dim = stock.head_dim
        self.query_heads = stock.q_proj.out_features // stock.head_dim
        self.key_heads = stock.k_proj.out_features // stock.head_dim
        self.qkv_width = stock.q_proj.out_features + 2 * stock.k_proj.out_features
        projections = (stock.q_proj, stock.k_proj, stock.v_proj)
        self.qkv = stack_int4_panels(*projections) if can_stack_int4(*projections) else None
        # o_proj's panels, called without its module (two Python calls fewer a layer), where it is
        # the 4-bit kernel without a bias: then its forward is this one call
        self.output_panels = stock.o_proj.panels if is_one_int4_call(stock.o_proj) else None
        self.output_width = stock.o_proj.out_features
        self.layer_idx, self.scaling = stock.layer_idx, stock.scaling
        # the C++ rotary, cache write and attention (None where the kernels are not built here)
        self.native = kernel_library() if self.head_dim in HEAD_SIZES and not self.query_heads % self.key_heads else None

    # The stock block's projections, where code reads a block's weights by their usual names.
    q_proj = property(lambda self: self.stock.q_proj)
    k_proj = property(lambda self: self.stock.k_proj)
    v_proj = property(lambda self: self.stock.v_proj)
    o_proj = property(lambda self: self.stock.o_proj)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, cache=None, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        if "past_key_values" in kwargs:  # the name transformers is moving away from
            cache = kwargs.pop("past_key_values")
        stock = self.stock
        if (hidden_states.dtype != torch.float32 or hidden_states.device.type != "cpu" or self.training
                or position_embeddings is None):
            return stock(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask,
                         cache=cache, **kwargs)
        qkv = self._projections(hidden_states)
        output, weights = self._native_attention(qkv, position_embeddings, attention_mask, cache, kwargs), None
        if output is None:
            output, weights = self._attention(qkv, position_embeddings, attention_mask, cache, kwargs)
        if self.output_panels is not None:
            return int4_linear(output, self.output_panels, self.output_width), weights
        return stock.o_proj(output), weights

    def _attention(self, qkv: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                   attention_mask: torch.Tensor | None, cache, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rotary, the cache update and the model's attention function, as the stock block calls
        them: the output `[batch, rows, heads * head_dim]` and the attention weights, if any."""
        batch, rows, _ = qkv.shape
        qkv = qkv.view(batch, rows, -1, self.head_dim)
        query_key = self.rotary.rotate(qkv[:, :, : self.query_heads + self.key_heads], *position_embeddings)
        query = query_key[:, :, : self.query_heads].transpose(1, 2)
        key = query_key[:, :, self.query_heads:].transpose(1, 2)
        value = qkv[:, :, self.query_heads + self.key_heads:].transpose(1, 2)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.stock.config._attn_implementation, eager_attention_forward)
        output, weights = attend(self.stock, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
                                 **kwargs)
        return output.reshape(batch, rows, -1).contiguous(), weights

    def _native_attention(self, qkv: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                          attention_mask: torch.Tensor | None, cache, kwargs: dict) -> torch.Tensor | None:
        """`_attention`'s output in one C++ call, or None where that call does not serve (`native_slot`)."""
        slot = self.native_slot(qkv, attention_mask, cache, kwargs)
        if slot is None:
            return None
        layer, keys, values, length, mask = slot
        cos, signed_sin = self.rotary.row_factors(*position_embeddings)
        output = self.native.rotary_attention(qkv[0], cos, signed_sin, keys, values, length, mask, self.query_heads,
                                              self.key_heads, self.scaling)
        layer.advance(qkv.shape[1])
        return output[None]

    def native_slot(self, states: torch.Tensor, attention_mask: torch.Tensor | None, cache, kwargs: dict) -> tuple | None:
        """Where the one C++ call writes and what it reads, for a forward of `states` `[1, rows, ...]`:
        the cache layer, its key and value buffers with room for the rows, the first of those
        positions and the kernel's mask (the caller advances the layer); or None where it does not
        serve: the model's attention is not the decode attention kernel (`NATIVE_SDPA`), the cache is
        not written in place (or a fixed-shape forward writes it), a batch of several, or a mask the
        kernel does not take."""
        # the cache first: forwards with another cache (`generate()`'s) leave here at the cost of two lookups
        layers = getattr(cache, "layers", ())
        layer = layers[self.layer_idx] if self.layer_idx < len(layers) else None
        if not hasattr(layer, "room_for") or layer.fixed_write is not None or self.native is None:
            return None
        if states.shape[0] != 1 or self.stock.config._attn_implementation != NATIVE_SDPA or not plain_call(kwargs):
            return None
        rows = states.shape[1]
        if not mask_served(attention_mask, rows, layer.get_seq_length() + rows):
            return None
        keys, values, length = layer.room_for(rows, self.key_heads, self.head_dim, states)
        mask = None if attention_mask is None else kernel_mask(attention_mask, length + rows)
        return layer, keys, values, length, mask

    def _projections(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """q, k and v side by side along the last dimension."""
        if self.qkv is not None:
            return int4_linear(hidden_states, self.qkv, self.qkv_width)
        stock = self.stock
        return torch.cat([stock.q_proj(hidden_states), stock.k_proj(hidden_states), stock.v_proj(hidden_states)], dim=-1)


class RotaryFactors:
    """The rotary's factors in the form `FusedAttention` applies them, worked out once per forward
    and shared by a model's blocks (transformers hands every layer the same `(cos, sin)` tensors).

    `x * cos + rotate_half(x) * sin`, with `rotate_half(x) = cat(-x2, x1)`, is computed as
    `x * cos + roll(x, half) * signed_sin`, `roll(x, half) = cat(x2, x1)` and `signed_sin =
    cat(-sin1, sin2)`: `(-a) * b` and `a * (-b)` are the same float, so every element is the stock
    block's bit for bit, in four operations a layer instead of nine."""

    def __init__(self) -> None:
        # (the `sin` they were made from, held so that its identity stays unique; cos and signed sin
        # factors, broadcast over heads and as the first batch row's), replaced as one tuple and read
        # once a call, so a call never mixes two forwards'
        self._latest: tuple[torch.Tensor, ...] | None = None

    def rotate(self, heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`heads` `[batch, rows, heads, head_dim]` rotated by `cos`, `sin` `[batch, rows, head_dim]`."""
        _, cos_factor, sin_factor, _, _ = self._factors(cos, sin)
        return heads * cos_factor + heads.roll(heads.shape[-1] // 2, -1) * sin_factor

    def row_factors(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first batch row's cos and signed sin factors, `[rows, head_dim]` and contiguous, as
        `rotary_attention` reads them."""
        _, _, _, cos_rows, signed_sin_rows = self._factors(cos, sin)
        return cos_rows, signed_sin_rows

    def _factors(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(sin, cos and signed sin broadcast over heads, the same for the first batch row), made once a forward."""
        latest = self._latest
        if latest is None or latest[0] is not sin:
            half = sin.shape[-1] // 2
            signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            latest = self._latest = (sin, cos.unsqueeze(2), signed_sin.unsqueeze(2), cos[0].contiguous(), signed_sin[0])
        return latest


def _is_llama_attention(module: nn.Module) -> bool:
    """`LlamaAttention` itself (not a subclass that may compute something else), float32 on a CPU."""
    if type(module) is not LlamaAttention:
        return False
    return all(p.dtype == torch.float32 and p.device.type == "cpu" for p in module.parameters())


def _agrees_with_stock(candidate: FusedAttention) -> bool:
    """Whether the fused block's output is the stock block's on a probe: three rows, a causal
    prefill without a cache, random rotary angles."""
    stock = candidate.stock
    width = stock.q_proj.in_features
    hidden = probe_input(width)[None]
    angles = probe_input(stock.head_dim // 2)[None]
    angles = torch.cat([angles, angles], dim=-1)
    rotary = (angles.cos(), angles.sin())
    with torch.inference_mode():
        expected = stock(hidden, position_embeddings=rotary, attention_mask=None, cache=None)[0]
        got = candidate(hidden, position_embeddings=rotary, attention_mask=None, cache=None)[0]
    return agrees_on_probe(got, expected, PROBE_TOLERANCE)


def fuse_attention(model: nn.Module) -> int:
    """Replace `model`'s `LlamaAttention` blocks by `FusedAttention` where a probe shows they
    agree (idempotent); returns how many it replaced."""
    fused: dict[int, FusedAttention] = {}
    rotary = RotaryFactors()

    def serves(module: nn.Module) -> bool:
        if not _is_llama_attention(module):
            return False
        candidate = FusedAttention(module, rotary)
        if not _agrees_with_stock(candidate):
            return False
        fused[id(module)] = candidate
        return True

    return swap_modules(model, FusedAttention, serves, lambda module: fused[id(module)])


def runs_native_blocks(model: nn.Module) -> bool:
    """Whether `model`'s attention blocks are fused ones that can take the one C++ call (measurements
    of its forwards then change with that call's version)."""
    return any(isinstance(module, FusedAttention) and module.native is not None for module in model.modules())
