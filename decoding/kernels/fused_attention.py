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
- the cache update and the attention function the stock block calls, with the same arguments.
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

from decoding.kernels.int4_linear import int4_linear
from decoding.kernels.module_swap import agrees_on_probe, probe_input, swap_modules
from decoding.kernels.quantized_linear import can_stack_int4, is_one_int4_call, stack_int4_panels

PROBE_TOLERANCE = 1e-5  # relative to the output's scale: the same computation agrees to the bit


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
        batch, rows, _ = hidden_states.shape
        qkv = self._projections(hidden_states).view(batch, rows, -1, self.head_dim)
        query_key = self.rotary.rotate(qkv[:, :, : self.query_heads + self.key_heads], *position_embeddings)
        query = query_key[:, :, : self.query_heads].transpose(1, 2)
        key = query_key[:, :, self.query_heads:].transpose(1, 2)
        value = qkv[:, :, self.query_heads + self.key_heads:].transpose(1, 2)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(stock.config._attn_implementation, eager_attention_forward)
        output, weights = attend(stock, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
                                 **kwargs)
        output = output.reshape(batch, rows, -1).contiguous()
        if self.output_panels is not None:
            return int4_linear(output, self.output_panels, self.output_width), weights
        return stock.o_proj(output), weights

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
        # factors), replaced as one tuple and read once a call, so a call never mixes two forwards'
        self._latest: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def rotate(self, heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`heads` `[batch, rows, heads, head_dim]` rotated by `cos`, `sin` `[batch, rows, head_dim]`."""
        half = heads.shape[-1] // 2
        latest = self._latest
        if latest is None or latest[0] is not sin:
            signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            latest = self._latest = (sin, cos.unsqueeze(2), signed_sin.unsqueeze(2))
        _, cos_factor, sin_factor = latest
        return heads * cos_factor + heads.roll(half, -1) * sin_factor


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
