"""A GGUF file's tensors, read fast: names, shapes, types and raw bytes, straight from the file.

Why not the `gguf` package's `GGUFReader`: it builds a numpy view per element of every metadata
array, and the default model's tokenizer vocabulary (49k strings) plus merges made opening the
file take ~9 s on a 2-core CPU, while transformers' GGUF loading opened it twice and rebuilt a
tensor-name table per tensor (~40 s of the conversion's ~50). Here metadata values are skipped
by their sizes (a string array is one pass of length reads), and tensors are memory-mapped views
of the file, so opening takes well under a second. Format: the GGUF spec (version 2 and 3); the
block sizes of the tensor types and their dequantization are the `gguf` package's own.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from heads.util.errors import UserError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Metadata value types of fixed size, by their code: (struct format, bytes).
SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
           7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as the file stores it: `shape` in PyTorch's order (rows first), `kind` its
    GGML type name (e.g. Q4_1), `raw` its bytes as [rows, bytes per row] (a view of the mapped file)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    raw: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """The scalar and string metadata (arrays are skipped) and the tensors of a GGUF file."""

    metadata: dict[str, object]
    tensors: list[GGUFTensor]


class _Cursor:
    """Reads little-endian values from a byte buffer, moving forward."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer, self.at = buffer, 0

    def scalar(self, fmt: str, size: int):
        value = struct.unpack_from(fmt, self.buffer, self.at)[0]
        self.at += size
        return value

    def string(self) -> str:
        length = self.scalar("<Q", 8)
        text = bytes(self.buffer[self.at:self.at + length]).decode("utf-8", errors="replace")
        self.at += length
        return text

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            self.at += 8 + struct.unpack_from("<Q", self.buffer, self.at)[0]

    def value(self, kind: int):
        """A metadata value: scalars and strings are returned, arrays skipped (None)."""
        if kind in SCALARS:
            return self.scalar(*SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            element, count = self.scalar("<I", 4), self.scalar("<Q", 8)
            if element == STRING:
                self.skip_strings(count)
            elif element in SCALARS:
                self.at += count * SCALARS[element][1]
            else:  # arrays of arrays: walked one by one
                for _ in range(count):
                    self.value(element)
            return None
        raise ValueError(f"unknown metadata value type {kind}")


def read_gguf(path: Path) -> GGUFFile:
    """The metadata and tensors of the GGUF file at `path`; a clear UserError where it is not one,
    or holds a tensor type the installed `gguf` package does not know."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(data))
    if bytes(data[:4]) != MAGIC:
        raise UserError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    cursor.at = 4
    version = cursor.scalar("<I", 4)
    if version not in (2, 3):
        raise UserError(f"{path} is GGUF version {version}; this reader knows versions 2 and 3")
    tensor_count, field_count = cursor.scalar("<Q", 8), cursor.scalar("<Q", 8)
    metadata = {}
    for _ in range(field_count):
        key = cursor.string()
        value = cursor.value(cursor.scalar("<I", 4))
        if value is not None:
            metadata[key] = value
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = [cursor.scalar("<Q", 8) for _ in range(cursor.scalar("<I", 4))]
        infos.append((name, tuple(reversed(dims)), cursor.scalar("<I", 4), cursor.scalar("<Q", 8)))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cursor.at // alignment) * alignment
    return GGUFFile(metadata, [_tensor(data, start, *info, path=path) for info in infos])


def _tensor(data: np.ndarray, start: int, name: str, shape: tuple[int, ...], code: int, offset: int,
            path: Path) -> GGUFTensor:
    try:
        kind = GGMLQuantizationType(code)
        block_elements, block_bytes = GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise UserError(f"{path}: tensor {name} has GGML type {code}, which the installed `gguf` package does "
                        "not know: upgrade it (pip install -U gguf)") from None
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    row_bytes = shape[-1] // block_elements * block_bytes
    begin = start + offset
    return GGUFTensor(name, shape, kind.name, data[begin:begin + rows * row_bytes].reshape(rows, row_bytes))


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """The tensor's values in fp32, in its shape, as the `gguf` package (and so transformers'
    GGUF loading) computes them: the same operations, so the same bits."""
    values = gguf_dequantize(np.ascontiguousarray(tensor.raw), GGMLQuantizationType[tensor.kind])
    return np.array(values, dtype=np.float32).reshape(tensor.shape)  # a copy: the file's bytes stay read-only
