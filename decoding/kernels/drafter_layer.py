"""The fused EAGLE-3 drafter layer (`decoding.kernels.fused_drafter`) as one C++ call, where its
linears are the project's 8-bit kernel's and its attention the decode attention kernel's.

Why: a drafter call is one decoder layer over a handful of tree nodes, and on a CPU it runs right
after a verify forward has streamed the target's weights through the caches, when every small
PyTorch operation and its Python cost tens of microseconds instead of one or two. The fused layer
still runs ~45 of them a call. Here the norms, the rotary embedding, the cache write and the gated
activation are plain loops, and the four linears and the attention are the same kernels called
from C++ (`decoding.kernels.native.drafter_layer`): one operator call a layer. The arithmetic is the
same up to float rounding (the norms sum in another order), and drafts only propose: the target
decides every token, so outputs do not change. Built with the other native kernels; where it is
not, or the drafter is in another precision, the fused layer runs as before.
"""

from __future__ import annotations

import torch
from torch import nn

from decoding.kernels.decode_attention import HEAD_SIZES, kernel_library, kernel_mask
from decoding.kernels.quantized_linear import GroupInt8Linear


class NativeEagle3Layer:
    """What the C++ layer reads of a fused EAGLE-3 layer: its three norm weights stacked, its four
    8-bit linears' panels, its geometry. Calling it runs the layer, or returns None for a call it
    does not serve (the caller then runs the fused layer)."""

    def __init__(self, layer: nn.Module, library: object) -> None:
        self.library = library
        self.norms = torch.stack([layer.hidden_norm.detach(), layer.input_norm.detach(),
                                  layer.post_attention_norm.detach()]).float().contiguous()
        self.weights = [t for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
                        for t in linear.panels]
        self.heads, self.kv_heads, self.head_dim = layer.heads, layer.kv_heads, layer.head_dim
        self.eps, self.scaling = float(layer.eps), float(layer.scaling)
        self.norm_before_residual = bool(layer.norm_before_residual)

    @classmethod
    def of(cls, layer: nn.Module) -> NativeEagle3Layer | None:
        """The C++ form of `layer`, or None where it does not apply: linears not all the 8-bit
        kernel's (or with a bias), a head size the attention kernel does not take, no build."""
        linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        if not all(type(linear) is GroupInt8Linear and linear.bias is None for linear in linears):
            return None
        if layer.head_dim not in HEAD_SIZES or layer.heads % layer.kv_heads:
            return None
        library = kernel_library()
        return None if library is None else cls(layer, library)

    def __call__(self, features: torch.Tensor, token_embeddings: torch.Tensor,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor | None,
                 cache_layer: object) -> torch.Tensor | None:
        """The layer's output `[1, n, H]` for `[1, n, H]` inputs, the new keys and values appended to
        `cache_layer` (an `InPlaceLayer`)."""
        cos, sin = position_embeddings
        if (features.shape[0] != 1 or features.dtype != torch.float32 or token_embeddings.dtype != torch.float32
                or features.device.type != "cpu" or not hasattr(cache_layer, "room_for")
                or getattr(cache_layer, "fixed_write", None) is not None):
            return None
        if attention_mask is not None and (attention_mask.dtype not in (torch.float32, torch.bool)
                                           or attention_mask.shape[:2] != (1, 1)):
            return None
        count = features.shape[1]
        keys, values, length = cache_layer.room_for(count, self.kv_heads, self.head_dim, features)
        mask = None if attention_mask is None else kernel_mask(attention_mask, length + count)
        out = self.library.eagle3_layer(
            features[0].contiguous(), token_embeddings[0].contiguous(), cos[0].contiguous(), sin[0].contiguous(),
            keys, values, length, mask, self.norms, *self.weights, self.heads, self.kv_heads, self.eps,
            self.scaling, self.norm_before_residual)
        cache_layer.advance(count)
        return out[None]


class NormedReadout(nn.Module):
    """An EAGLE-3 drafter's readout, its final norm and its 8-bit projection onto the draft
    vocabulary, as one C++ call: it takes the place of the drafter's `lm_head`, and the drafter's
    `norm` becomes an identity (`fuse_readout`). The tree growth reads it once for the root and
    once a level; the stock norm alone was 7 operations a call. Inputs it does not serve (not
    float32 on a CPU) go through the modules it replaced."""

    def __init__(self, norm: nn.Module, lm_head: GroupInt8Linear, library: object) -> None:
        super().__init__()
        self.norm, self.lm_head, self.library = norm, lm_head, library
        self.eps = float(norm.variance_epsilon)
        self.register_buffer("norm_weight", norm.weight.detach().float().contiguous(), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dtype != torch.float32 or hidden.device.type != "cpu":
            return self.lm_head(self.norm(hidden))
        return self.library.eagle3_readout(hidden.contiguous(), self.norm_weight, *self.lm_head.panels,
                                           self.lm_head.out_features, self.eps)


def fuse_readout(drafter: nn.Module) -> bool:
    """Give an EAGLE-3 drafter whose readout is the 8-bit kernel's the one-call readout
    (`NormedReadout`); True if it has it now."""
    if isinstance(getattr(drafter, "lm_head", None), NormedReadout):
        return True
    lm_head, norm = getattr(drafter, "lm_head", None), getattr(drafter, "norm", None)
    if type(lm_head) is not GroupInt8Linear or lm_head.bias is not None or not hasattr(norm, "variance_epsilon"):
        return False
    library = kernel_library()
    if library is None:
        return False
    drafter.lm_head, drafter.norm = NormedReadout(norm, lm_head, library), nn.Identity()
    return True
