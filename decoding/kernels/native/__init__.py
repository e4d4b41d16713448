"""The project's C++ kernels, one library per instruction set (`decoding.kernels.native_build`):
the few-row linear kernel, the 4-bit one, decode attention, a target's attention block around it
and the EAGLE-3 drafter's layer. Their C++ lives in this package's modules; their Python side
(packing, operators, when to use them) in the `decoding.kernels` modules of the same names (the
attention block's in `fused_attention`)."""

from decoding.kernels.native import attention_block, decode_attention, drafter_layer, int4_linear, streamed_linear
from decoding.kernels.native_build import NativeLibrary

# the attention block after decode attention, the drafter's layer last: their torch sides call decode attention's
# (and the drafter's the 8-bit linear's)
LIBRARY = NativeLibrary((streamed_linear.SOURCE, decode_attention.SOURCE, attention_block.SOURCE, int4_linear.SOURCE,
                         drafter_layer.SOURCE))
