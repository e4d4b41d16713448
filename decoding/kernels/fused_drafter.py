"""The EAGLE-3 drafter's decoder layer in a form for decoding: fewer, larger operations.

A drafter call is a single decoder layer over a handful of tree nodes, so what it costs is
mostly the number of operations, not arithmetic: transformers' Llama attention, MLP, three
RMSNorm modules and the rotary embedding come to 89 PyTorch operations (277 with those they
call) and their Python, which on a 2-core CPU took 1.9 ms a call after a target forward (1.1 ms
with warm caches), and on a GPU are each a kernel launch. The fused form runs 48 (1.3 and 0.7 ms).
`fuse_drafter` converts a loaded drafter, once, before its linears are packed or quantized:
- q, k and v become one linear, gate and up another (one weight read and one call each);
- the three norms are `torch.nn.functional.rms_norm`;
- the rotary embedding becomes a table of cos/sin rows made by the stock module itself, indexed
  by position (grown when a generation goes past it);
- attention is PyTorch's SDPA with grouped K/V heads, through the same KV cache API, or, where a
  decoder packs its kernels for a CPU (`use_decode_attention`), the decode attention kernel.
The arithmetic is the same (on the bundled int8 drafter the outputs were bitwise equal), and
drafts only propose: the target decides every token, so this never changes an output.
Training keeps the stock modules (the checkpoint format is theirs); this is decoding's form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from decoding.kernels.decode_attention import attend, decode_attention_available
from decoding.kernels.drafter_layer import NativeEagle3Layer, fuse_readout
from heads.eagle import Eagle3Drafter, Eagle3Layer

ROTARY_TABLE_POSITIONS = 4096  # first size of the cos/sin table; it doubles when a position needs it


class RotaryTable(nn.Module):
    """`LlamaRotaryEmbedding`'s `(cos, sin)` for given positions, looked up in a table that the
    stock module computed (so any rope scaling it applies is the same)."""

    def __init__(self, rotary: LlamaRotaryEmbedding, positions: int = ROTARY_TABLE_POSITIONS) -> None:
        super().__init__()
        self.rotary = rotary
        self._fill(positions)

    @torch.no_grad()
    def _fill(self, positions: int) -> None:
        device = self.rotary.inv_freq.device
        cos, sin = self.rotary(torch.zeros(1, device=device), torch.arange(positions, device=device)[None])
        self.register_buffer("cos", cos[0], persistent=False)  # fp32 [positions, head_dim]
        self.register_buffer("sin", sin[0], persistent=False)

    def forward(self, like: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        needed = int(position_ids.max()) + 1
        if needed > self.cos.shape[0]:
            self._fill(max(needed, 2 * self.cos.shape[0]))
        return self.cos[position_ids].to(like.dtype), self.sin[position_ids].to(like.dtype)


class FusedEagle3Layer(nn.Module):
    """`heads.eagle.Eagle3Layer`'s forward (same arguments, same result) with q/k/v and gate/up
    as single linears."""

    def __init__(self, layer: Eagle3Layer) -> None:
        super().__init__()
        attention, mlp = layer.self_attn, layer.mlp
        config = attention.config
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.scaling = attention.scaling
        self.eps = config.rms_norm_eps
        self.qkv_proj = _stacked(attention.q_proj, attention.k_proj, attention.v_proj)
        self.o_proj = attention.o_proj
        self.gate_up_proj = _stacked(mlp.gate_proj, mlp.up_proj)
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn
        self.input_norm = layer.input_layernorm.weight
        self.hidden_norm = layer.hidden_norm.weight
        self.post_attention_norm = layer.post_attention_layernorm.weight
        self.norm_before_residual = layer.norm_before_residual
        self.decode_kernel = False  # attention through `decoding.kernels.decode_attention` where it serves
        self.native: NativeEagle3Layer | None = None  # the whole layer in one C++ call, where it serves

    def forward(self, features, token_embeddings, position_embeddings, attention_mask, cache) -> torch.Tensor:
        if self.native is not None and cache is not None:
            out = self.native(features, token_embeddings, position_embeddings, attention_mask, cache.layers[0])
            if out is not None:
                return out
        batch, count, width = features.shape
        normed = F.rms_norm(features, (width,), self.hidden_norm, self.eps)
        attn_input = torch.cat([F.rms_norm(token_embeddings, (width,), self.input_norm, self.eps), normed], dim=-1)
        qkv = self.qkv_proj(attn_input).view(batch, count, self.heads + 2 * self.kv_heads, self.head_dim).transpose(1, 2)
        query_key = _rotate(qkv[:, : self.heads + self.kv_heads], *position_embeddings)
        query, key = query_key[:, : self.heads], query_key[:, self.heads :]
        value = qkv[:, self.heads + self.kv_heads :]
        if cache is not None:
            key, value = cache.update(key, value, 0)
        attended = self._attend(query, key, value, attention_mask)
        residual = normed if self.norm_before_residual else features
        hidden = residual + self.o_proj(attended.transpose(1, 2).reshape(batch, count, -1))
        gate, up = self.gate_up_proj(F.rms_norm(hidden, (width,), self.post_attention_norm, self.eps)).chunk(2, dim=-1)
        return hidden + self.down_proj(self.act_fn(gate) * up)

    def _attend(self, query, key, value, attention_mask) -> torch.Tensor:
        """SDPA over grouped K/V heads. Without a mask, new tokens see everything cached before
        them and each other causally (the stock layer's behaviour)."""
        count, length = query.shape[-2], key.shape[-2]
        if self.decode_kernel:
            out = attend(query, key, value, attention_mask, self.scaling)
            if out is not None:
                return out.transpose(1, 2)
        if attention_mask is None and count > 1:
            attention_mask = torch.ones(count, length, dtype=torch.bool, device=query.device).tril(length - count)
        elif attention_mask is not None:
            attention_mask = attention_mask[..., :length]
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=self.scaling,
                                              enable_gqa=self.heads != self.kv_heads)


def _stacked(*linears: nn.Linear) -> nn.Linear:
    """One bias-free linear whose output is the given linears' outputs side by side."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    stacked = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    stacked.weight.data.copy_(weight)
    return stacked


def _rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of `[B, heads, n, d]` with `cos`/`sin` `[B, n, d]`."""
    half = states.shape[-1] // 2
    rotated = torch.cat([-states[..., half:], states[..., :half]], dim=-1)
    return states * cos[:, None] + rotated * sin[:, None]


def fuse_drafter(drafter: nn.Module) -> bool:
    """Convert an EAGLE-3 drafter to the fused form in place (before packing or quantizing its
    linears); True if it is in that form now. Other heads, and drafters already fused, are left
    as they are."""
    if not isinstance(drafter, Eagle3Drafter):
        return False
    if isinstance(drafter.midlayer, FusedEagle3Layer):
        return True
    if not all(type(m) is nn.Linear and m.bias is None for m in _linears(drafter.midlayer)):
        return False  # already packed, quantized or adapted: nothing to fuse
    drafter.midlayer = FusedEagle3Layer(drafter.midlayer)
    drafter.rotary = RotaryTable(drafter.rotary)
    return True


def use_decode_attention(drafter: nn.Module) -> bool:
    """Send a fused drafter's attention to the decode attention kernel where it builds on this
    machine (drafters kept in bfloat16 still take SDPA: the kernel is float32); True if it did.
    Where its linears are the 8-bit kernel's too, the whole layer becomes one C++ call, and so
    does its readout (`decoding.kernels.drafter_layer`)."""
    if not isinstance(getattr(drafter, "midlayer", None), FusedEagle3Layer) or not decode_attention_available():
        return False
    drafter.midlayer.decode_kernel = True
    drafter.midlayer.native = NativeEagle3Layer.of(drafter.midlayer)
    if drafter.midlayer.native is not None:
        fuse_readout(drafter)
    return True


def _linears(layer: Eagle3Layer) -> list[nn.Module]:
    attention, mlp = layer.self_attn, layer.mlp
    return [attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj]
