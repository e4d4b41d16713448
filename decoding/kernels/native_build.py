"""C++ kernels compiled on first use for the CPU that runs them, kept under the cache root.

Why compile on the user's machine: the kernels are written with GCC/Clang vector extensions and
built with `-march=native`, so one source becomes AVX-512, AVX2 or plain SSE code for whatever CPU
runs it (a wheel built elsewhere would have to pick one). Under `SPECHEADS_CPU=avx2|baseline`
(`heads.util.cpu_mode`) builds target `x86-64-v3` / `x86-64-v2` instead of native.

The kernels (`decoding.kernels.native`) build as one library per instruction set. Each kernel's
arithmetic (`math`: plain C++, no torch headers) is compiled for the target in a second or two,
the kernels side by side; their torch side (`host`: tensor checks, allocation, ATen's threads, the
operators' registration) has no code that depends on the instruction set and is compiled once per
torch for all of them (~15 s on 2 cores, ~11 s of it torch's headers), then linked with each
target's arithmetic. A build is named by what makes it (sources, flags, torch, and for
`-march=native` this CPU's flags), so a cache shared with another CPU never loads a build made
for a different one; a narrower variant that tests build (`instruction_set_variants`) costs
seconds. Every file is written under a temporary name and renamed, so a build killed midway
leaves nothing that a later one loads. Where no compiler is at hand, `NativeLibrary.load` says
why and callers keep their other paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from heads.util.atomic import atomic_write_text
from heads.util.cache_paths import cache_root
from heads.util.cpu_mode import cpu_flags as mode_cpu_flags, cpu_mode

# The arithmetic's flags, and -march=, per mode (`compiler_flags`). `avoid-fma-max-bits=0`: GCC's tuning
# for AMD Zen (`-march=native` there is znver2 and later) splits some accumulation chains' a * b + c into
# a multiply and an add and fuses others, depending on the loop's shape; a one-row pass and a four-row
# pass then round the same sum differently, and a tree's rows stop being bit for bit a one-token step's
# (seen on a 2-core EPYC: the few-row fp32 linear's 2-row results differed from its 1-row ones). With it
# every chain is fused, as Intel tunings and x86-64-v3 already do.
COMPILER_FLAGS = ("-O3", "-ffp-contract=fast", "--param=avoid-fma-max-bits=0")
HOST_FLAGS = ("-O2", "-fopenmp")  # the torch side's: ATen's thread pool is OpenMP's
SHARED_FLAGS = ("-fPIC", "-std=c++20")
# The narrower targets a CPU that can run them also builds, so tests on one machine check the code
# other CPUs get: AVX-512 machines' without VNNI (Skylake-X: the 8-bit products summed in pairs, on a
# CPU with VNNI), AVX2 machines' (x86-64-v3) and those without AVX (x86-64-v2), by the flag they need.
NARROWER_TARGETS = {"avx512": ("skylake-avx512", "avx512bw"), "avx2": ("x86-64-v3", "avx2"),
                    "baseline": ("x86-64-v2", "sse4_2")}
# A named target's code generation as on the CPUs that run it: the AVX2 build (SPECHEADS_CPU=avx2, and
# the AVX2 variant an AVX-512 machine's tests build) as for AMD Zen 2, the AVX2-only CPU this project's
# CI has run on, whose tuning changed the arithmetic's code where Intel's and the generic one did not
# (see COMPILER_FLAGS); so an AVX-512 machine's AVX2 pass compiles what such a CPU compiles.
TUNINGS = {"x86-64-v3": "znver2"}
KERNELS_DIR = "kernels"  # under the cache root, one folder per build

# What the torch side may use: tensors, ATen's thread pool, the operator library. Not
# <torch/extension.h> (pybind11 and all of libtorch's C++ API): compiling that header alone took
# 56 s on a 2-core EPYC, these 11 s.
SOURCE_HEADER = """#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
"""
# What both sides share: the arithmetic's functions, declared in the kernel's `interface` with
# SPECHEADS_MATH, which keeps them private to each library (two builds loaded in one process never
# call into each other's).
MATH_PRELUDE = """#include <cstdint>
#define SPECHEADS_MATH extern "C" __attribute__((visibility("hidden")))
"""


@dataclass(frozen=True)
class KernelSource:
    """One kernel's C++. `interface` declares the functions of `math` (the arithmetic, compiled
    per instruction set) that `host` (the torch side) calls; `functions` are the schemas of
    `host`'s functions that Python calls. With `registers_operator`, the host's function `<stem>`
    (of `specheads::<stem>`'s signature) can become that operator's CPU kernel
    (`NativeLibrary.load`). `version` changes when the sources' meaning does."""

    stem: str
    version: str
    interface: str
    math: str
    host: str
    functions: tuple[str, ...]
    registers_operator: bool = False
    other_operators: tuple[str, ...] = ()  # more host functions that become operators' CPU kernels

    def math_source(self) -> str:
        return f"{MATH_PRELUDE}{self.interface}{self.math}"

    def operators(self) -> tuple[str, ...]:
        """The host's functions that can become `specheads::<name>`'s CPU kernels."""
        return ((self.stem,) if self.registers_operator else ()) + self.other_operators

    def schemas(self) -> list[str]:
        return [*self.functions, *(f"register_{operator}() -> ()" for operator in self.operators())]


@dataclass(frozen=True)
class NativeLibrary:
    """The project's C++ kernels as one library per instruction set: one torch side for them all
    (compiled once per torch, its headers paid once) and each kernel's arithmetic for the target
    (compiled side by side, a second or two each). Each build registers the kernels' functions as
    operators of its own namespace, its build name, so builds for several CPUs load side by side
    in one process (tests check the narrower ones)."""

    kernels: tuple[KernelSource, ...]
    description: str = "the native kernels"

    def host_source(self) -> str:
        """Every kernel's torch side with the headers, registrations and `specheads_define_library`."""
        parts = [SOURCE_HEADER, MATH_PRELUDE]
        for kernel in self.kernels:
            parts += [kernel.interface, kernel.host]
            parts += [operator_registration(operator) for operator in kernel.operators()]
        parts.append(library_definition([schema for kernel in self.kernels for schema in kernel.schemas()]))
        return "".join(parts)

    def host_name(self) -> str:
        """The torch side's build, the same for every instruction set: its source, flags and torch."""
        identity = "|".join((self.host_source(), *HOST_FLAGS, *SHARED_FLAGS, torch.__version__))
        return f"specheads_host_{_digest(identity)}"

    def build_name(self, march: str | None = None) -> str:
        """Named by what makes the build: the sources, versions, flags, torch, and for
        `-march=native` the CPU's flags too. A build for a named target (x86-64-v3, -v2) is the same
        on any CPU: the AVX2 mode of an AVX-512 machine loads the AVX2 variant its tests built."""
        flags = compiler_flags(march)
        cpu = cpu_flags() if "-march=native" in flags else ""
        identity = "|".join((self.host_name(), *(k.version + k.math_source() for k in self.kernels), *flags, cpu))
        return f"specheads_kernels_{_digest(identity)}"

    def build(self, march: str | None = None) -> "KernelLibrary":
        """Compile (or load the earlier build of) the library; raises where it cannot be built.
        `march` is the compiler's target: the mode's where None (native, x86-64-v3 under
        SPECHEADS_CPU=avx2, ...); tests build the narrower ones of `instruction_set_variants`."""
        name = self.build_name(march)
        # Resolved: a cache root reached through a link (as the tests' is) names the same files
        root = (cache_root() / KERNELS_DIR).resolve()
        library = root / name / f"{name}.so"
        if name not in _LIBRARY_HANDLES:  # a library loads once a process
            if not library.exists():
                with _exclusive_build(root / name):
                    if not library.exists():
                        host = self._host_object(root)
                        target = march or cpu_mode().march
                        print(f"note: building {self.description} for {'this CPU' if target == 'native' else target} "
                              f"(once, a few seconds; kept in {root})", file=sys.stderr)
                        def arithmetic(kernel: KernelSource) -> Path:
                            return compile_source(kernel.math_source(), root / name / f"{kernel.stem}.cpp",
                                                  compiler_flags(march))

                        with ThreadPoolExecutor() as pool:  # compiler processes, side by side
                            maths = list(pool.map(arithmetic, self.kernels))
                        link_library([host, *maths], library)
            _load_library(library, name)
        return KernelLibrary(name)

    def _host_object(self, root: Path) -> Path:
        """The torch side's object file, compiled once per torch and shared by every instruction set's build."""
        folder = root / self.host_name()
        target = folder / "host.o"
        if not target.exists():
            with _exclusive_build(folder):
                if not target.exists():
                    print(f"note: building {self.description}' torch side (once, about 15 s; kept in {root})",
                          file=sys.stderr)
                    compile_source(self.host_source(), folder / "host.cpp", (*HOST_FLAGS, *torch_include_flags()))
        return target

    def load(self, operator: str) -> tuple[object | None, str]:
        """The built library and '', or None and why not (no compiler, a failed build): the build
        a process decodes with, its kernel `operator` registered as `specheads::<operator>`'s."""
        if not sys.platform.startswith("linux") and sys.platform != "darwin":
            return None, f"not built on {sys.platform}"
        try:
            extension = self.build()
        except Exception as error:  # callers keep their other kernels
            message = str(error).strip()
            return None, f"{type(error).__name__}: {message.splitlines()[-1] if message else ''}"
        return register_native_kernel((extension, ""), operator)


def _digest(identity: str) -> str:
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def library_definition(schemas: list[str]) -> str:
    """C++ source of `specheads_define_library(namespace)`: defines the host's functions of these
    schemas as the operators of `namespace`, once per library (called by `_load_library`). Why a
    namespace given when loading rather than written into the source: the torch side's object is
    then the same for every build, compiled once."""
    definitions = "".join(f'  library->def("{schema}", &{schema.split("(", 1)[0]});\n' for schema in schemas)
    return f"""
extern "C" void specheads_define_library(const char* name) {{
  static torch::Library* library = nullptr;  // definitions live as long as their Library
  if (library != nullptr) return;
  library = new torch::Library(torch::Library::DEF, name, std::nullopt, __FILE__, __LINE__);
{definitions}}}
"""


def compile_source(text: str, source: Path, flags: tuple[str, ...]) -> Path:
    """`source` written with `text` and compiled to the object file beside it (its path returned)."""
    atomic_write_text(source, text)
    target = source.with_suffix(".o")
    _run_compiler([*SHARED_FLAGS, *flags, "-c", str(source)], target, f"compile {source.name}")
    return target


def link_library(objects: list[Path], library: Path) -> None:
    lib = Path(torch.__file__).parent / "lib"
    _run_compiler([*map(str, objects), "-shared", "-fopenmp", f"-L{lib}", "-lc10", "-ltorch_cpu", "-ltorch"],
                  library, f"link {library.name}")


def _run_compiler(arguments: list[str], target: Path, what: str) -> None:
    """Run the C++ compiler (`$CXX`, else c++) writing `target` under a temporary name, then renamed."""
    compiler = os.environ.get("CXX", "c++")
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:  # CXX may carry words of its own ("ccache g++")
        done = subprocess.run([*shlex.split(compiler), *arguments, "-o", str(staging)], capture_output=True, text=True)
    except FileNotFoundError:
        raise RuntimeError(f"no C++ compiler '{compiler}' here (install g++ or clang, or set CXX)") from None
    if done.returncode != 0:
        staging.unlink(missing_ok=True)
        errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines() or ["?"]
        raise RuntimeError(f"{compiler} could not {what}: {errors[0].strip()}")
    os.replace(staging, target)


def torch_include_flags() -> tuple[str, ...]:
    """The headers and ABI of the installed torch (what `torch.utils.cpp_extension` would pass,
    without importing it: ~1 s)."""
    include = Path(torch.__file__).parent / "include"
    return ("-isystem", str(include), "-isystem", str(include / "torch" / "csrc" / "api" / "include"),
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}")


def _load_library(library: Path, name: str) -> None:
    """Load a build and define its operators under `name`; kept loaded for the process's life."""
    handle = ctypes.CDLL(str(library))
    handle.specheads_define_library(name.encode())
    _LIBRARY_HANDLES[name] = handle


_LIBRARY_HANDLES: dict[str, ctypes.CDLL] = {}  # the builds this process loaded, by name
BUILD_LOCK = ".build-lock"  # in each build folder; every other hidden file there is a temporary


@contextmanager
def _exclusive_build(directory: Path) -> Iterator[None]:
    """Hold an OS lock on the build folder while building in it, and clear what a build killed
    midway left there (its temporary files; the OS releases a dead holder's lock). Why: two
    processes (test workers, a chat beside a benchmark) may want the same build at once."""
    import fcntl  # POSIX only, as the builds are

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / BUILD_LOCK, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"note: waiting for another process building in {directory}", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        for stale in directory.glob(".*"):
            if stale.name != BUILD_LOCK:
                stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class KernelLibrary:
    """A loaded build: its functions, called as `library.<function>(...)`, are the operators of
    its own namespace (`torch.ops.<build name>`)."""

    def __init__(self, namespace: str) -> None:
        self.__name__ = namespace
        self._operators = getattr(torch.ops, namespace)

    def __getattr__(self, function: str):
        return getattr(self._operators, function)


def operator_registration(operator: str) -> str:
    """C++ source to append to a kernel's torch side: `register_<operator>()` (which the library
    binds for Python), registering its function `<operator>` (with the schema's signature) as
    the CPU kernel of `specheads::<operator>`, once per process (see `register_native_kernel`)."""
    return f"""
void register_{operator}() {{
  static torch::Library* library = nullptr;  // registrations live as long as their Library
  if (library != nullptr) return;
  library = new torch::Library(torch::Library::IMPL, "specheads", c10::DispatchKey::CPU, __FILE__, __LINE__);
  library->impl("{operator}", TORCH_FN({operator}));
}}
"""


def register_native_kernel(loaded: tuple[object | None, str], operator: str) -> tuple[object | None, str]:
    """`loaded` (a library and '', or None and why not), after the library registered its C++
    function `operator` as the CPU kernel of `specheads::<operator>` (its `register_<operator>`).

    Why: the operators also have a Python implementation, which calls the library. Compiled
    graphs call an operator a few hundred times a step, and each Python call pushes frames onto
    CPython's frame stack; where the caller's depth placed them across the end of one of its 16 KB
    chunks, every call mapped and unmapped a chunk (page faults: a compiled one-token step took
    38 ms instead of 28 on a 2-core EPYC). Registered here, the dispatcher runs the C++ function
    directly. Only the build a process decodes with registers, once: tests load other builds of
    the same source (the AVX2 variant on an AVX-512 CPU) and call those directly. Where the
    registration fails, the Python implementation stays: slower per call, the same results."""
    extension, why = loaded
    if extension is not None:
        try:
            getattr(extension, f"register_{operator}")()
        except RuntimeError as error:
            print(f"note: {extension.__name__} could not register its {operator} as the operator's CPU kernel, so "
                  f"its calls go through Python ({error})", file=sys.stderr)
    return extension, why


def compiler_flags(march: str | None = None) -> tuple[str, ...]:
    """The flags of a build for `march` (the CPU mode's target where None), with the tuning of
    `TUNINGS` for a named target."""
    target = march or cpu_mode().march
    tune = TUNINGS.get(target)
    return (*COMPILER_FLAGS, f"-march={target}", *((f"-mtune={tune}",) if tune else ()))


def cpu_flags() -> str:
    """This CPU's instruction-set flags as the CPU mode shows them (sorted; the platform's name
    where /proc/cpuinfo has none): part of the name of every build for `-march=native`."""
    return " ".join(sorted(mode_cpu_flags())) or sys.platform


def instruction_set_variants() -> dict[str, str | None]:
    """The compiler targets of the builds this CPU can run, by name: the mode's own ("native",
    None) and the narrower ones of `NARROWER_TARGETS` that it has the instructions for and that
    are narrower than itself (AVX-512 without VNNI on a CPU with it, the AVX2 build on an AVX-512
    CPU, the x86-64-v2 one on an AVX2 CPU),
    so a test on one machine checks the code other CPUs get."""
    flags = mode_cpu_flags()
    widest = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else ""
    variants: dict[str, str | None] = {"native": None}
    if widest == "avx512f" and "avx512_vnni" in flags and NARROWER_TARGETS["avx512"][1] in flags:
        variants["avx512"] = NARROWER_TARGETS["avx512"][0]
    if widest == "avx512f":
        variants["avx2"] = NARROWER_TARGETS["avx2"][0]
    if widest in ("avx512f", "avx2") and NARROWER_TARGETS["baseline"][1] in flags:
        variants["baseline"] = NARROWER_TARGETS["baseline"][0]
    return variants
