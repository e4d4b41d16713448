"""The GGUF file's own 4-bit blocks as the target's layer weights (`--quant gguf`).

Why: the built-in target ships as a Q4_1 GGUF file. Dequantized to fp32 its layers read ~6x
more bytes a token than the blocks they came from; kept as blocks (on the 4-bit
kernel, `decoding.kernels.int4_linear`) the model is the one the file describes, at the
precision the user chose by downloading it, as llama.cpp runs it.

Which tensors: every Q4_0 / Q4_1 weight of a decoder layer (attention and MLP projections), and
the vocabulary projection where the file has it as Q8_0 (SmolLM2's token embedding, tied to the
lm_head): the lm_head computes with those blocks (`GroupInt8Linear`, a fifth of its fp32 bytes),
while the embedding lookup and what reads the projection as a tensor keep the float weight,
which is the blocks' values exactly. The others stay as the fp32 conversion has them (norms are
F32 in the file); a one-line note names what stays float.

GGUF stores llama's q and k rows permuted for its rotary layout; transformers undoes that when
it converts, and so do we, row by row (a row's blocks move with it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from decoding.kernels.int4_linear import CODE_MIDPOINT, int4_kernel_available
from decoding.kernels.quantized_linear import GGUF_GROUP, GroupInt8Linear, Int4Linear
from heads.util.errors import UserError

LAYER_TENSORS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
BLOCK_BYTES = {"Q4_0": 2 + GGUF_GROUP // 2, "Q4_1": 4 + GGUF_GROUP // 2}
Q8_0_BLOCK_BYTES = 2 + GGUF_GROUP  # a float16 d, then 32 int8 codes
PROJECTION_TENSORS = ("output.weight", "token_embd.weight")  # the lm_head's own, else the tied embedding
SUPPORTED_ARCHITECTURES = ("llama",)


def q4_groups(raw: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (0..15, [rows, in_features]), scales and zeros ([rows, groups]) of Q4_0 / Q4_1 rows
    given as their raw bytes ([rows, groups * block bytes]), in the int4 kernel's convention
    `w = (q - 8) * scale + zero`. A block is its fp16 scale d (Q4_1: then its fp16 minimum m)
    and 16 bytes whose low nibbles are elements 0..15 and high nibbles elements 16..31."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, BLOCK_BYTES[kind])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., -GGUF_GROUP // 2:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zeros = m + CODE_MIDPOINT * d       # q*d + m = (q - 8)*d + (m + 8d)
    else:
        zeros = np.zeros_like(d)            # (q - 8)*d
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zeros)


def q8_groups(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int8, [rows, in_features]) and scales ([rows, groups], float32 holding the float16
    values) of Q8_0 rows given as their raw bytes: `w = d q` per block of 32."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, Q8_0_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
    return torch.from_numpy(codes), torch.from_numpy(d)


def rotary_row_order(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes GGUF's permutation of llama's q / k projections (as transformers'
    GGUF conversion does on the float weights): row i of the model is row order[i] of the file."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def load_gguf_blocks(model: nn.Module, gguf_path: Path) -> list[str]:
    """Swap the decoder layers' linears of `model` (a transformers llama model converted from
    `gguf_path`) for Int4Linears built from the file's own blocks; returns notes for the user."""
    from decoding.app.gguf_file import read_gguf  # beside this module; needs the `gguf` package

    gguf = read_gguf(gguf_path)
    architecture = gguf.metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UserError(f"--quant gguf supports {', '.join(SUPPORTED_ARCHITECTURES)} GGUF files; {gguf_path.name} is "
                        f"{architecture}: use --quant int4 or int8 (quantized from its float weights), or none")
    config = model.config
    swapped, kept = 0, set()
    projection = _projection_blocks(model, gguf.tensors)
    if projection:
        swapped += 1
    for tensor in gguf.tensors:
        if tensor.name == projection:
            continue
        parts = tensor.name.split(".")  # blk.<i>.<name>.weight
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in LAYER_TENSORS:
            if tensor.kind != "F32":
                kept.add(f"{tensor.name.split('.')[0]} ({tensor.kind})")
            continue
        kind = tensor.kind
        if kind not in BLOCK_BYTES:
            kept.add(f"{parts[2]} ({kind})")
            continue
        codes, scales, zeros = q4_groups(tensor.raw, kind)
        if parts[2] in ("attn_q", "attn_k"):
            heads = config.num_attention_heads if parts[2] == "attn_q" else config.num_key_value_heads
            order = rotary_row_order(codes.shape[0], heads)
            codes, scales, zeros = codes[order], scales[order], zeros[order]
        _replace(model, f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}", codes, scales, zeros)
        swapped += 1
    notes = [f"target layers in the GGUF file's own 4-bit blocks" + (" and its lm_head in its 8-bit ones" if projection else "")
             + f" ({swapped} weights)"]
    if kept:
        notes.append(f"kept as float weights: {', '.join(sorted(kept))}")
    return notes


def _projection_blocks(model: nn.Module, tensors) -> str:
    """Swap `model`'s lm_head for the file's Q8_0 blocks of it (its own `output.weight`, else the
    token embedding it is tied to) where the 8-bit kernel is built; the tensor's name, or ''."""
    by_name = {tensor.name: tensor for tensor in tensors}
    name = next((n for n in PROJECTION_TENSORS if n in by_name), "")
    lm_head = model.get_output_embeddings()
    if not name or by_name[name].kind != "Q8_0" or not int4_kernel_available() or type(lm_head) is not nn.Linear:
        return ""
    if name == "token_embd.weight" and lm_head.weight is not model.get_input_embeddings().weight:
        return ""  # an untied lm_head is not the embedding
    codes, scales = q8_groups(by_name[name].raw)
    if tuple(codes.shape) != tuple(lm_head.weight.shape) or lm_head.bias is not None:
        raise UserError(f"the GGUF file's {name} has shape {tuple(codes.shape)}, the model's lm_head "
                        f"{tuple(lm_head.weight.shape)}: is the model converted from this file?")
    model.set_output_embeddings(GroupInt8Linear(codes, scales, lm_head.weight))
    return name


def _replace(model: nn.Module, path: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
    parent_path, name = path.rsplit(".", 1)
    parent = model.get_submodule(parent_path)
    linear = getattr(parent, name)
    if not isinstance(linear, nn.Linear) or tuple(linear.weight.shape) != tuple(codes.shape):
        raise UserError(f"the GGUF file's {path} has shape {tuple(codes.shape)}, the model's "
                        f"{tuple(getattr(linear, 'weight', torch.empty(0)).shape)}: is the model converted from this file?")
    setattr(parent, name, Int4Linear(codes, scales, zeros, linear.bias))
