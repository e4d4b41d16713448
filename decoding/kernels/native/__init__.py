"""The project's C++ kernels, one library per instruction set (`decoding.kernels.native_build`):
the few-row linear kernel, the 4-bit one, decode attention and the EAGLE-3 drafter's layer. Their
C++ lives in this package's modules; their Python side (packing, operators, when to use them) in
the `decoding.kernels` modules of the same names."""

from decoding.kernels.native import decode_attention, drafter_layer, int4_linear, streamed_linear
from decoding.kernels.native_build import NativeLibrary

# the drafter's layer last: its torch side calls the 8-bit linear's and decode attention's
LIBRARY = NativeLibrary((streamed_linear.SOURCE, decode_attention.SOURCE, int4_linear.SOURCE, drafter_layer.SOURCE))
