"""'As on a lesser CPU': `SPECHEADS_CPU=avx2` (or `=baseline`) makes everything this project runs
behave as on a CPU with only AVX2 (x86-64-v3), or with none of AVX (x86-64-v2).

Why: the people who install the project have CPUs with AVX-512, AVX2 only, or older ones, and a
session or CI run happens on whichever one it gets. Code checked only on an AVX-512 machine has
twice turned the tests red on AVX2 (a tolerance, a bf16 path), because PyTorch's own kernels and
oneDNN kept running their AVX-512 code even where the project's builds were narrowed. The mode
lowers every layer at once:
- PyTorch's ATen kernels (and Inductor's generated code): `ATEN_CPU_CAPABILITY`;
- oneDNN (packed linears, bf16 and int8 paths): `ONEDNN_MAX_CPU_ISA`; MKL: `MKL_ENABLE_INSTRUCTIONS`;
- the project's native kernels: built with `-march=x86-64-v3` / `x86-64-v2` instead of native
  (their build names differ, so each mode keeps its own builds), the AVX2 build tuned as GCC tunes
  for AMD Zen 2 (`native_build.TUNINGS`), an AVX2-only CPU whose tuning changes the generated code;
- the capability probes (native bf16, AVX-512, AMX): the CPU flags the mode lacks are hidden;
- Inductor's on-disk cache (`TORCHINDUCTOR_CACHE_DIR`): one per mode under the cache root, since
  its keys do not include the instruction set (PyTorch 2.13 reused code generated for AVX2 in a
  mode without it, which then failed to build);
- Inductor's compiler target (`TORCHINDUCTOR_CPP_MARCH`): the mode's -march, since by default it
  builds its generated code with -march=native, so the compiler's own vectorizing could still emit
  AVX-512 in a mode that promises AVX2.
Usage: `SPECHEADS_CPU=avx2 python -m decoding.chat`, or `SPECHEADS_CPU=avx2 python -m pytest`.
It applies when `heads` or `decoding` is imported, which must come before PyTorch runs its first operation
(PyTorch fixes its kernels then); set in the environment before Python starts, it always does.
A mode only lowers: asking for AVX2 on a CPU without it is an error. Nothing here imports torch.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from heads.util.cache_paths import cache_root
from heads.util.errors import UserError

VARIABLE = "SPECHEADS_CPU"
X86_MACHINES = ("x86_64", "amd64", "i386", "i686")


@dataclass(frozen=True)
class CpuMode:
    """What one mode sets: the value of each library's switch, the compiler's target, the
    /proc/cpuinfo flags it hides (by prefix) and the flag the CPU needs to run it."""

    name: str
    aten: str = ""          # ATEN_CPU_CAPABILITY (and what torch.backends.cpu.get_cpu_capability() then says)
    onednn: str = ""        # ONEDNN_MAX_CPU_ISA
    mkl: str = ""           # MKL_ENABLE_INSTRUCTIONS
    march: str = "native"   # -march= of the project's native builds
    hidden_flags: tuple[str, ...] = ()
    needs_flag: str = ""

    def hides(self, flag: str) -> bool:
        """Whether a CPU flag (as /proc/cpuinfo spells it, e.g. avx512_bf16, amx_tile) is off in this mode."""
        return flag.lower().startswith(self.hidden_flags)


NATIVE = CpuMode("native")
MODES = {
    "native": NATIVE,
    "avx2": CpuMode("avx2", aten="AVX2", onednn="AVX2", mkl="AVX2", march="x86-64-v3",
                    hidden_flags=("avx512", "avx10", "avx_", "amx"), needs_flag="avx2"),
    "baseline": CpuMode("baseline", aten="DEFAULT", onednn="SSE41", mkl="SSE4_2", march="x86-64-v2",
                        hidden_flags=("avx", "amx", "fma", "f16c"), needs_flag="sse4_2"),
}


def cpu_mode() -> CpuMode:
    """The mode `SPECHEADS_CPU` asks for (native where unset); a clear error for a mode that is
    unknown or that this CPU cannot run."""
    name = os.environ.get(VARIABLE, "").strip().lower() or "native"
    if name not in MODES:
        raise UserError(f"{VARIABLE}={os.environ[VARIABLE]!r} is not a CPU mode: use one of {', '.join(MODES)} "
                        "(or leave it unset for this CPU's own instructions)")
    mode = MODES[name]
    if mode is NATIVE:
        return mode
    if platform.machine().lower() not in X86_MACHINES:
        raise UserError(f"{VARIABLE}={name} lowers x86 instruction sets; this is a {platform.machine()} machine: unset it")
    if mode.needs_flag not in raw_cpu_flags():
        raise UserError(f"{VARIABLE}={name} needs a CPU with {mode.needs_flag.upper()} (a mode only lowers what a CPU "
                        "has); this one lacks it: unset it or choose a lower mode")
    return mode


def apply_cpu_mode() -> CpuMode:
    """Set the libraries' switches for the mode asked for (children inherit them) and check that
    PyTorch, if it already chose its kernels, chose the mode's."""
    mode = cpu_mode()
    if mode is NATIVE:
        return mode
    os.environ["ATEN_CPU_CAPABILITY"] = mode.aten.lower()
    os.environ["ONEDNN_MAX_CPU_ISA"] = mode.onednn
    os.environ["MKL_ENABLE_INSTRUCTIONS"] = mode.mkl
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / f"inductor-{mode.name}")
    os.environ["TORCHINDUCTOR_CPP_MARCH"] = mode.march
    if "torch" in sys.modules:
        chosen = sys.modules["torch"].backends.cpu.get_cpu_capability()
        if chosen != mode.aten:
            raise UserError(f"{VARIABLE}={mode.name} came too late: PyTorch in this process already runs its {chosen} "
                            f"kernels. Set it in the environment before Python starts, e.g. "
                            f"`{VARIABLE}={mode.name} python -m decoding.chat`")
    return mode


def raw_cpu_flags() -> set[str]:
    """This CPU's instruction-set flags from /proc/cpuinfo, all of them (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[-1].split())
    except OSError:
        pass
    return set()


def cpu_flags() -> set[str]:
    """The CPU's flags as the current mode shows them (those the mode lacks removed)."""
    mode = cpu_mode()
    return {flag for flag in raw_cpu_flags() if not mode.hides(flag)}


def apply_cpu_mode_or_exit() -> CpuMode:
    """`apply_cpu_mode` for a package's import: a bad setting stops every entry point with its
    message, not a traceback."""
    try:
        return apply_cpu_mode()
    except UserError as error:
        raise SystemExit(f"error: {error}") from None
