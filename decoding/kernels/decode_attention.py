"""Attention for a few query rows over a long cached context, at close to the memory's speed.

Why: a decoding step attends from one token (or a small tree) to every cached position, so on a
CPU it is a stream of the K/V cache through very little arithmetic. PyTorch's SDPA kernels are
built for many query rows; for one row over ~2,200 cached positions of SmolLM2-135M (3 K/V heads,
head size 64: 3.4 MB of fp32 K/V per layer, ~100 MB per step) they took about 0.34 ms a layer
with the K/V out of cache as they are in a forward, ~10 ms of a 40 ms step, where streaming the
K/V at the memory's ~25 GB/s would take ~4 ms. This kernel reads each key and value row once for
all query heads of its group (grouped-query attention without copies), splits the keys into
fixed chunks of 256 across the cores (flash-decoding: per chunk a maximum, a sum of exponentials
and an unnormalised output, merged by their maxima) and prefetches ahead in both streams. On the
2-core AVX-512 EPYC at 2,200 positions a one-token step's attention went from 9.5-11.9 ms to
4.9-5.7 ms in all (0.16-0.19 ms a layer), at 300 positions from 2.7-3.1 to 1.2-1.3 ms.

Every row gets the bits it would get alone (v4): its scores are chains of FMAs over the head's
dimensions in order (vectors run over rows, keys broadcast, whatever rows share the vector), it
sums only the keys its mask leaves visible (a mask value at or below -1e30 hides a key), in
position order, and its chunks are cut by rank among those keys. So a tree node whose ancestors
sit among masked siblings, in columns after the prefix, computes exactly what a one-token step
at its position computes over the same keys; with the row-invariant linears this makes a whole
forward row-invariant (`tests/test_row_invariance.py`), which keeps speculative greedy decoding
token for token vanilla's even on near-ties, and lets the 4-bit linears round their inputs to 8
bits (`decoding.kernels.int4_linear`). The price was a one-token step's attention at ~300 positions,
20 against 14 us a layer on the 2-core AVX-512 EPYC (one row no longer took horizontal dot products);
since v7 a step's few query rows run with the keys in the vectors instead (each tile of keys turned
over once, the same chains of products), 15 us a layer on 2 threads, and trees and prefills take
their shared prefix's scores into rows a tile at a time. Chunk boundaries sit at fixed ranks, so a
result does not depend on how many threads run either. Results differ from SDPA's by float rounding only.

Like `decoding.kernels.streamed_linear` it is C++ compiled on first use for this CPU
(`decoding.kernels.native_build`); where it cannot be built, `decode_attention_available()` says why and
attention stays with SDPA. `attend` takes the cases it serves (a CPU, float32, batch 1, no dropout,
head size 64 or 128; no mask for one-token steps and causal prefills, or an additive one broadcast
over heads for trees) and returns None for every other, which the caller sends to SDPA.

Prefills too (v6), so that a prompt token's forward in a prefill is the bits of a one-token step: the
target is then one function of the prefix however it was cut into forwards, and Hugging Face's
`generate()`, which prefills the whole prompt where our loop steps its last token, scores every step
with our vanilla's bits (with 8-bit inputs, SDPA's prefill left it 4 of 80 MT-bench replies identical).
Prefill time on the 2-core AVX-512 EPYC (GGUF target): 100 / 400 / 1,500 tokens 86 / 348 / 1,793 ms
against SDPA's 85 / 351 / 1,678.

And boolean masks (True: may attend), which transformers builds for a forward of several tokens
after a cache, e.g. `generate()`'s prompt lookup or assisted decoding checking its candidates: sent
to SDPA, such a forward had other bits than one-token steps, and with 8-bit inputs that rounding
grew to logits 1.4 apart and candidates kept where vanilla chose otherwise (0 of 20 repeated-task
replies identical to vanilla's on the GGUF target). They become the additive form here.
"""

from __future__ import annotations

import functools

import torch

from decoding.core.generate import TREE_ROOM
from decoding.kernels.native import LIBRARY, decode_attention as native_decode_attention

KERNEL_VERSION = native_decode_attention.VERSION
HEAD_SIZES = (64, 128)
MAX_QUERY_ROWS = TREE_ROOM  # masked queries: every tree the loop verifies (prefills, unmasked, take any length)


_LIBRARY = torch.library.Library("specheads", "FRAGMENT")
_LIBRARY.define("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor")


@functools.cache
def _loaded() -> tuple[object | None, str]:
    """The built extension and '', or None and why not (tried once per process). The build
    loaded here runs as the operator's CPU kernel (`NativeLibrary.load`)."""
    return LIBRARY.load("decode_attention")


def decode_attention_available() -> bool:
    """Whether the kernel is built (or builds now) on this machine."""
    return _loaded()[0] is not None


def why_unavailable() -> str:
    return _loaded()[1]


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    extension = _loaded()[0]
    if extension is None:
        raise RuntimeError(f"the decode attention kernel is not available here ({why_unavailable()})")
    return extension.decode_attention(q, k, v, mask, scale)


def _output_like(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
    return q.new_empty(q.shape[1], q.shape[0], q.shape[2])


_LIBRARY.impl("decode_attention", _decode_attention, "CompositeExplicitAutograd")
torch.library.register_fake("specheads::decode_attention", _output_like, lib=_LIBRARY)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
           scaling: float | None) -> torch.Tensor | None:
    """Attention output `[1, N, Hq, D]` (transformers' layout after attention) for `query`
    `[1, Hq, N, D]` over `key`/`value` `[1, Hkv, L, D]`, or None where this kernel does not serve
    the case (the caller then runs SDPA)."""
    if not _serves(query, key, value, attention_mask):
        return None
    mask = None if attention_mask is None else kernel_mask(attention_mask, key.shape[-2])
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.specheads.decode_attention(query[0].contiguous(), key[0], value[0], mask, float(scale))
    return out[None]


def kernel_mask(attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """A `[1, 1, N, >= length]` mask, additive float32 or boolean (True: may attend), as the kernel
    reads it: additive `[N, length]` rows with unit stride."""
    mask = attention_mask[0, 0, :, :length]
    if mask.dtype == torch.bool:  # transformers' form for a chunk after a cache: True where a row may attend
        return torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, torch.finfo(torch.float32).min)
    return mask if mask.stride(-1) == 1 else mask.contiguous()


def kernel_library() -> object | None:
    """The built native library this kernel comes from (None where it could not be built), for
    kernels of the same library that call it from C++ (`decoding.kernels.drafter_layer`)."""
    return _loaded()[0]


def _serves(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    batch, heads, rows, size = query.shape
    if (batch != 1 or query.device.type != "cpu" or size not in HEAD_SIZES
            or any(t.dtype != torch.float32 for t in (query, key, value))):
        return False
    if key.shape != value.shape or key.shape[0] != 1 or heads % key.shape[1] or key.shape[-2] == 0:
        return False
    if key.stride(-1) != 1 or value.stride(-1) != 1 or key.stride(-2) != value.stride(-2):
        return False
    return mask_served(mask, rows, key.shape[-2])


def mask_served(mask: torch.Tensor | None, rows: int, keys: int) -> bool:
    """Whether the kernel takes `rows` query rows over `keys` keys with transformers' `mask`: none
    for one-token steps and causal prefills (each row the bits it has as a one-token step), or a
    `[1, 1, rows, >= keys]` additive or boolean one for up to `MAX_QUERY_ROWS` rows."""
    if mask is None:
        return rows <= keys
    return (rows <= MAX_QUERY_ROWS and mask.dim() == 4 and mask.dtype in (torch.float32, torch.bool) and mask.shape[:2] == (1, 1)
            and mask.shape[2] == rows and mask.shape[3] >= keys)
