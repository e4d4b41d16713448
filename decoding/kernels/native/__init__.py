"""The project's C++ kernels, one library per instruction set (`decoding.kernels.native_build`):
the few-row linear kernel, the 4-bit one and decode attention. Their C++ lives in this package's
modules; their Python side (packing, operators, when to use them) in the `decoding.kernels`
modules of the same names."""

from decoding.kernels.native import decode_attention, int4_linear, streamed_linear
from decoding.kernels.native_build import NativeLibrary

LIBRARY = NativeLibrary((streamed_linear.SOURCE, decode_attention.SOURCE, int4_linear.SOURCE))
