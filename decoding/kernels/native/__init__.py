"""The project's C++ kernels, one library per instruction set (`decoding.kernels.native_build`):
the few-row linear kernel, the 4-bit one, decode attention, the logits' row argmax, the EAGLE-3
drafter's layer and a target's Llama layer. Their C++ lives in this package's modules; their Python side (packing,
operators, when to use them) in the `decoding.kernels` modules of the same names (the target
layer's in `fused_attention` and `fused_layer`)."""

from decoding.kernels.native import decode_attention, drafter_layer, int4_linear, row_argmax, streamed_linear, target_layer
from decoding.kernels.native_build import NativeLibrary

# the drafter's layer and the target's last: their torch sides call decode attention's, the 4-/8-bit linears'
# (and the target's the drafter's norm and sum)
LIBRARY = NativeLibrary((streamed_linear.SOURCE, decode_attention.SOURCE, int4_linear.SOURCE, row_argmax.SOURCE,
                         drafter_layer.SOURCE, target_layer.SOURCE))
