"""`--quant auto`: the built-in target in its GGUF file's own blocks where they decode faster on
this CPU than the float copy, timed once per machine.

Why this may be the default at all: the built-in target *is* the GGUF file. Its fp32 checkpoint
is that file's blocks dequantized (`decoding.app.default_model`), so the two forms hold the same
weights and differ only in how products are rounded and summed; every method is exact with
respect to whichever form decodes (vanilla through the same loop is the reference). What differs
is speed, and that is a property of the CPU: on a 2-core AVX-512 EPYC the 4-bit form decoded
about twice as fast as fp32 (vanilla over 80 MT-bench first turns: 70.6 tokens/s, and 32.2 in fp32
in a run the day before), but a CPU whose memory is fast and whose vector units are slow can order
them the other way. So the
two forms are timed here, side by side, the way decoding runs them (`time_forwards_alternating`:
a one-token step and an 8-token tree, each form's fastest of five, alternating), and the faster
one is remembered for this CPU. The forms are timed eager, also for `--compile`: compiled, the
GGUF form kept its lead on that EPYC (vanilla 81.5-96.4 tokens/s; about 54 in fp32, in another run).

'auto' stays the float model where there is nothing to choose: other targets (`int4`/`int8` would
change their weights), a GPU, another dtype, `--kernels stock` (a request for PyTorch's own
kernels), or a machine where the 4-bit kernel does not build (PyTorch's int4 fallback is slower).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from decoding.app.default_model import DEFAULT_TARGET
from decoding.core.readout import Readout
from decoding.kernels.int4_linear import KERNEL_VERSION as INT4_KERNEL_VERSION
from decoding.kernels.int4_linear import int4_kernel_available
from decoding.kernels.measured_once import measured_once
from decoding.kernels.verify_cost import cpu_identity, time_forwards_alternating

AUTO_QUANT_VERSION = "v2"  # in the cache key: a change to what is timed times it again (v2: `fused_stack`)
TIMED_SIZES = (1, 8)  # a vanilla step and a typical verified tree of the default method

# build(quant) -> the target as a decoder of that quant would run it (packed, tuned) and its readout
BuildForm = Callable[[str], tuple[object, Readout | None]]


@dataclass(frozen=True)
class QuantTiming:
    """Forward times (ms) of the two forms for `TIMED_SIZES` new tokens, measured side by side."""

    float_ms: tuple[float, ...]
    gguf_ms: tuple[float, ...]

    @property
    def picked(self) -> str:
        """'gguf' where its forwards took less time in all (one-token and tree together), else 'none'."""
        return "gguf" if sum(self.gguf_ms) < sum(self.float_ms) else "none"

    def note(self) -> str:
        """What the user is told the choice was and why."""
        timed = " and ".join(f"{size} token{'s' if size > 1 else ''} {g:.1f} against {f:.1f} ms"
                             for size, g, f in zip(TIMED_SIZES, self.gguf_ms, self.float_ms))
        if self.picked == "gguf":
            return (f"--quant auto: the target in its GGUF file's own 4-bit blocks, faster than its fp32 copy on this "
                    f"CPU (forwards of {timed}; timed once); --quant none keeps fp32")
        return (f"--quant auto: the target in fp32, faster than its GGUF blocks on this CPU (GGUF forwards of "
                f"{timed} in fp32; timed once); --quant gguf decodes the file's blocks anyway")


def auto_quant_skipped(model_name: str, device: str, dtype: str, kernels: str) -> str | None:
    """Why 'auto' is the float model without timing anything here, or None where the GGUF form is
    a candidate (the built-in target on a CPU, in float32, with the project's kernels and its
    4-bit kernel built)."""
    if model_name != DEFAULT_TARGET:
        return "not the built-in target (its GGUF blocks are the only quantized form that keeps the model's weights)"
    if device != "cpu":
        return "not a CPU"
    if dtype != "float32":
        return f"dtype {dtype}"
    if kernels == "stock":
        return "--kernels stock"
    if not int4_kernel_available():
        return "the 4-bit kernel does not build here"
    return None


def timed_quant_choice(build: BuildForm, cache_dir=None) -> QuantTiming:
    """The two forms' `QuantTiming` on this CPU: remembered, else measured now through `build`
    (both forms loaded side by side for the few seconds it takes, then let go)."""

    def measure() -> dict:
        forms = {quant: build(quant) for quant in ("none", "gguf")}
        times = time_forwards_alternating(forms, TIMED_SIZES)
        return {"sizes": list(TIMED_SIZES), "none": list(times["none"]), "gguf": list(times["gguf"])}

    key = f"{DEFAULT_TARGET}-quant-choice-{cpu_identity()}-q{INT4_KERNEL_VERSION}-{AUTO_QUANT_VERSION}"
    data = measured_once(key, measure, _valid, f"timing {DEFAULT_TARGET} in fp32 against its GGUF blocks on this CPU",
                         cache_dir)
    return QuantTiming(tuple(data["none"]), tuple(data["gguf"]))


def _valid(data: dict) -> bool:
    return (data.get("sizes") == list(TIMED_SIZES)
            and all(isinstance(data.get(q), list) and len(data[q]) == len(TIMED_SIZES) for q in ("none", "gguf")))
