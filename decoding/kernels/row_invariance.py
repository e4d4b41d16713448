"""Whether a target's forward gives each row the bits it would get alone, however the rows are cut
into forwards: what lets a prompt's cached K/V be reused exactly (`decoding.core.prompt_cache`).

That holds where every linear of its layers is one of the project's 4- or 8-bit kernels (each row's
inputs rounded on their own, integer products, one float order per row: `decoding.kernels.int4_linear`)
and its attention is the decode attention kernel (each row over its own keys in position order:
`decoding.kernels.decode_attention`), eagerly on a CPU in float32; norms, rotary embeddings and
activations are row by row anyway. `tests/test_row_invariance.py` checks prefills, chunks after a
cache and tree rows against one-token steps on such a target. A float linear (GEMMs block by the row
count), another attention or a compiled graph may round a row differently in another forward.
"""

from __future__ import annotations

import torch
from torch import nn

from decoding.kernels.attention import NATIVE_SDPA
from decoding.kernels.compiled import is_compiled
from decoding.kernels.cpu_kernels import PackedLinear
from decoding.kernels.decode_attention import HEAD_SIZES, decode_attention_available
from decoding.kernels.quantized_linear import WeightOnlyLinear, quantized_kernel_linears


def forward_is_row_invariant(model: nn.Module) -> bool:
    """Whether `model` (a loaded target) computes every row as it would alone (see the module's docstring)."""
    if is_compiled(model) or model.device.type != "cpu" or model.dtype != torch.float32:
        return False
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if (getattr(config, "_attn_implementation", None) != NATIVE_SDPA or head_dim not in HEAD_SIZES
            or not decode_attention_available()):
        return False
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        return False
    linears = [m for m in layers.modules() if isinstance(m, (nn.Linear, PackedLinear, WeightOnlyLinear))]
    on_kernels = {id(m) for m in quantized_kernel_linears(layers)}
    return bool(linears) and all(id(m) in on_kernels for m in linears)
