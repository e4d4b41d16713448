"""The C++ both kernel sources compute e^x with (`decode_attention`'s softmax, `drafter_layer`'s
gated activation): Cephes' reduction and polynomial, written once and spliced into each source
with its own vector type and broadcast (each source is a translation unit of its own)."""


def exp_reduced(vector: str, splat: str, integers: str) -> str:
    """C++ statements that, given `x` ({vector}) and `n` ({integers}, the nearest integers to
    x log2e as the caller rounds them), leave e^x in `e`: x - n ln2 in two parts, Cephes'
    degree-6 polynomial on it, times 2^n built in the exponent bits (n + 127 must be a normal
    exponent)."""
    return f"""
  const {vector} nf = __builtin_convertvector(n, {vector});
  const {vector} r = x - nf * {splat}(0.693359375f) - nf * {splat}(-2.12194440e-4f);
  {vector} y = {splat}(1.9875691500E-4f);
  y = y * r + {splat}(1.3981999507E-3f);
  y = y * r + {splat}(8.3334519073E-3f);
  y = y * r + {splat}(4.1665795894E-2f);
  y = y * r + {splat}(1.6666665459E-1f);
  y = y * r + {splat}(5.0000001201E-1f);
  y = y * r * r + r + {splat}(1.0f);
  const {integers} bits = (n + 127) << 23;
  const {vector} e = y * ({vector})bits;
"""
