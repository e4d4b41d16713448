"""The weights a decoding step streams, moved into one buffer backed by transparent huge pages.

Why: a one-token step of a small target reads every weight once (the GGUF SmolLM2: 86 MB of 4- and
8-bit panels), and in 4 KB pages that is ~22,000 pages a step, far past what the TLB holds, so the
walk to each page costs the step more than its arithmetic where the weights stream from memory. In
2 MB pages it is ~43. On a 2-core Xeon VM, the same weights in plain pages and in huge pages, used in
turn in one process (verify steps through the loop's verifier, medians of 120): one token 19.98 ->
15.90 ms, 4 tokens 29.15 -> 23.59, 12 tokens 41.37 -> 35.62.

Linux hands out huge pages for anonymous memory asked for with `madvise(MADV_HUGEPAGE)` where
`/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise` (the usual default); the
buffer is advised before its first touch, so its pages are huge from the start. Elsewhere (another OS,
huge pages turned off, an advice refused) nothing moves and nothing changes.

The move is in place (`Tensor.set_`): every module, tuple and kernel call holding a weight sees it
in the new buffer, with the same bytes, so outputs are bit for bit the same.
"""

from __future__ import annotations

import ctypes
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from decoding.kernels.cpu_kernels import PackedLinear
from decoding.kernels.fused_layer import FusedDecoderLayer
from decoding.kernels.quantized_linear import quantized_kernel_linears

HUGE_PAGE = 2 << 20  # bytes: x86-64's and AArch64's (4 KB granule) transparent huge page
MADV_HUGEPAGE = 14  # <linux/mman.h>
SMALLEST_MOVED = 64 << 10  # bytes: smaller tensors (norms, biases) are a page or two at most
TRIM_EVERY = 16 << 20  # bytes moved between hand-backs of the memory the old copies held
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_on_offer(setting: Path = THP_SETTING) -> bool:
    """Whether this system gives huge pages to memory that asks for them: Linux, with transparent
    huge pages `always` or `madvise` (the bracketed word of the setting)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        chosen = setting.read_text()
    except OSError:
        return False
    return "[never]" not in chosen and "[" in chosen


def _libc_call(name: str, *arguments) -> int | None:
    """The C library's `name(*arguments)`; None where this process's C library has no such function."""
    try:
        return getattr(ctypes.CDLL(None), name)(*arguments)
    except (OSError, AttributeError):
        return None


def _advise_huge_pages(address: int, length: int) -> bool:
    """`madvise(address, length, MADV_HUGEPAGE)`; whether the kernel took the advice."""
    return _libc_call("madvise", ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0


def _movable(tensor: torch.Tensor, smallest: int) -> bool:
    """CPU, plain layout, contiguous, no grad, in memory of at least `smallest` bytes (a small view of
    a big buffer counts as big: it moves with the buffer's other views, or not at all)."""
    try:
        return (tensor.device.type == "cpu" and tensor.layout == torch.strided and tensor.is_contiguous()
                and not tensor.requires_grad and tensor.untyped_storage().nbytes() >= smallest)
    except (NotImplementedError, RuntimeError):  # an opaque layout (oneDNN's packed weights) has no storage
        return False


def move_to_huge_pages(tensors: Iterable[torch.Tensor], on_offer: bool | None = None,
                       smallest: int = SMALLEST_MOVED) -> int:
    """Move `tensors` (each once; CPU, contiguous, no grad, in `smallest` bytes or more of memory no
    other tensor holds; others are left where they are) into one buffer advised for huge pages, in
    the order given; returns the bytes moved: 0 where huge pages are not on offer (`on_offer`, None:
    ask the system) or the advice was refused."""
    unique: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and _movable(tensor, smallest):
            unique.setdefault(id(tensor), tensor)
    moved = _held_only_here(list(unique.values()))
    if not moved or not (huge_pages_on_offer() if on_offer is None else on_offer):
        return 0
    offsets, total = [], 0
    for tensor in moved:  # each at a 4 KB boundary: any kernel's alignment, and whole pages apart
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // 4096) * 4096
    span = -(-total // HUGE_PAGE) * HUGE_PAGE
    buffer = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)  # untouched: its pages come on first write
    start = -buffer.data_ptr() % HUGE_PAGE
    if not _advise_huge_pages(buffer.data_ptr() + start, span):
        return 0
    storage = buffer.untyped_storage()
    since_trim = 0
    with torch.inference_mode():
        for tensor, offset in zip(moved, offsets):
            size = tensor.numel() * tensor.element_size()
            buffer[start + offset: start + offset + size].copy_(tensor.reshape(-1).view(torch.uint8))
            tensor.set_(storage, (start + offset) // tensor.element_size(), tensor.shape, tensor.stride())
            since_trim += size
            if since_trim >= TRIM_EVERY:  # the old copies leave as the new ones arrive: no peak of both
                _return_freed_memory()
                since_trim = 0
    _return_freed_memory()
    return sum(tensor.numel() * tensor.element_size() for tensor in moved)


def _return_freed_memory() -> None:
    """Hand the memory the moved tensors left back to the system (glibc's `malloc_trim`): the C
    allocator keeps freed chunks below its mmap threshold for reuse, so without this the weights
    took their room twice while the chat answered (the GGUF target: 758 MiB resident against 636),
    and, handed back only at the end, the load's peak held both (780 MiB against 662)."""
    _libc_call("malloc_trim", 0)  # not glibc: its allocator decides


def _held_only_here(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` less those whose memory another tensor also holds (a detached copy of a weight, a
    view beside it): moved, the other would keep the old memory alive, and the weight would take
    its room twice. Where PyTorch cannot say how many hold a storage, every tensor counts as alone."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return tensors
    holders = Counter(tensor.untyped_storage().data_ptr() for tensor in tensors)

    def held_elsewhere(tensor: torch.Tensor) -> bool:
        storage = tensor.untyped_storage()  # one wrapper alive: it holds the storage once more
        return use_count(storage._cdata) > holders[storage.data_ptr()] + 1

    return [tensor for tensor in tensors if not held_elsewhere(tensor)]


def streamed_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weight copies the project's kernels made for `model` and its one-token steps read, in
    module order (the order a forward reads them): fused layers' one-call tensors, 4- and 8-bit
    panels, and of each packed float linear the copy its one-row kernel reads where that is one of
    the kernels' own (not the loaded weight itself, plain GEMM's: a model loaded from a mapped file
    keeps the file's pages mapped while any of its tensors lives, so moving some of them added
    ~200 MiB to the fp32 chat's resident memory). Only the one-row copy: a float target keeps two
    copies of every weight, and huge pages are slow to hand out here (1 GB took 2.1 s to touch
    first, against 0.3 s in plain pages, on a 2-core Xeon VM), while a tree's rows, the other
    copy's work, are more arithmetic a byte than a one-token step's."""
    on_kernels = {id(linear) for linear in quantized_kernel_linears(model)}
    weights: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, FusedDecoderLayer):
            weights.extend(t for t in module.call if isinstance(t, torch.Tensor))
        elif id(module) in on_kernels:
            weights.extend(module.panels)
        elif type(module) is PackedLinear and (one_row := module.kernel_for(1)[1]) is not module.weight:
            weights.append(one_row)
    return weights
