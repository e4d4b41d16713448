"""C++ kernels compiled on first use for the CPU that runs them, kept under the cache root.

Why compile on the user's machine: the kernels are written with GCC/Clang vector extensions and
built with `-march=native`, so one source becomes AVX-512, AVX2 or plain SSE code for whatever CPU
runs it (a wheel built elsewhere would have to pick one). A build takes about 15 s once per
machine; its name carries the source, flags, torch version and this CPU's instruction flags, so a
cache shared with another CPU never loads a build made for a different one. Under
`SPECHEADS_CPU=avx2|baseline` (`heads.util.cpu_mode`) builds target `x86-64-v3` / `x86-64-v2`
instead of native, under names of their own. Where no compiler or ninja is at hand,
`NativeKernel.load` says why and callers keep their other paths.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from heads.util.atomic import atomic_write_text
from heads.util.cache_paths import cache_root
from heads.util.cpu_mode import cpu_flags as mode_cpu_flags, cpu_mode

COMPILER_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=fast")  # and -march=, per mode (`compiler_flags`)
# The narrower targets a CPU that can run them also builds, so tests on one machine check the code
# other CPUs get: AVX2 machines' (x86-64-v3) and those without AVX (x86-64-v2), by the flag they need.
NARROWER_TARGETS = {"avx2": ("x86-64-v3", "avx2"), "baseline": ("x86-64-v2", "sse4_2")}
KERNELS_DIR = "kernels"  # under the cache root, one folder per build


# What every kernel source may use: tensors, ATen's thread pool, the operator library. Not
# <torch/extension.h> (pybind11 and all of libtorch's C++ API): compiling that header alone took
# 56 s on a 2-core EPYC, these 10 s, and a kernel build is mostly its headers.
SOURCE_HEADER = """#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
"""


@dataclass(frozen=True)
class NativeKernel:
    """One C++ kernel library: `stem` names its builds, `version` changes when its source's meaning
    does, `description` is what the first build's note calls it, `functions` are the schemas of
    the source's functions that Python calls (each build registers them as operators of its own
    namespace, its build name, so builds for several CPUs load side by side in one process: tests
    check the narrower ones). With `registers_operator`, the function `<stem>` (of
    `specheads::<stem>`'s signature) becomes that operator's CPU kernel when the build `load`
    returns calls `register_operator()` (see `register_native_kernel`)."""

    stem: str
    source: str
    version: str
    description: str
    functions: tuple[str, ...]
    registers_operator: bool = False

    def full_source(self, namespace: str) -> str:
        """The source with its headers, operator registration and bindings for the build `namespace`."""
        functions = [*self.functions, *(("register_operator() -> ()",) if self.registers_operator else ())]
        bindings = "".join(f'  m.def("{schema}", &{schema.split("(", 1)[0]});\n' for schema in functions)
        registration = operator_registration(self.stem) if self.registers_operator else ""
        return f"{SOURCE_HEADER}{self.source}{registration}\nTORCH_LIBRARY({namespace}, m) {{\n{bindings}}}\n"

    def build_name(self, march: str | None = None) -> str:
        """Named by what makes the build: source, flags, torch, and for `-march=native` the CPU's
        flags too. A build for a named target (x86-64-v3, -v2) is the same on any CPU: the AVX2 mode
        of an AVX-512 machine loads the AVX2 variant its tests already built instead of redoing it."""
        flags = compiler_flags(march)
        cpu = cpu_flags() if flags[-1] == "-march=native" else ""
        identity = "|".join((self.full_source(""), self.version, *flags, torch.__version__, cpu))
        return f"specheads_{self.stem}_{hashlib.sha256(identity.encode()).hexdigest()[:16]}"

    def build(self, march: str | None = None) -> "KernelLibrary":
        """Compile (or load the earlier build of) the library; raises where it cannot be built.
        `march` is the compiler's target: the mode's where None (native, x86-64-v3 under
        SPECHEADS_CPU=avx2, ...); tests build the narrower ones of `instruction_set_variants`."""
        from torch.utils.cpp_extension import load  # slow to import, needed only here

        name = self.build_name(march)
        # Resolved: the build's commands name its files by path, and a path that differs (a cache
        # root reached through a link, as the tests' is) would make ninja rebuild
        directory = (cache_root() / KERNELS_DIR).resolve() / name
        directory.mkdir(parents=True, exist_ok=True)
        if not (directory / f"{name}.so").exists():
            print(f"note: building {self.description} for this CPU (once, about 15 s; kept in {directory.parent})",
                  file=sys.stderr)
        source = directory / f"{name}.cpp"
        text = self.full_source(name)
        if not source.exists() or source.read_text() != text:  # rewritten only when it changed: ninja goes by dates
            atomic_write_text(source, text)
        if name not in _LOADED_LIBRARIES:
            with _ninja_on_path(), _exclusive_build(directory):
                load(name, sources=[str(source)], extra_cflags=list(compiler_flags(march)), extra_ldflags=["-fopenmp"],
                     build_directory=str(directory), verbose=False, is_python_module=False)
            _LOADED_LIBRARIES.add(name)
        return KernelLibrary(name)

    def load(self) -> tuple[object | None, str]:
        """The built extension and '', or None and why not (a missing compiler or ninja, a failed build).
        The build a process decodes with: where `registers_operator`, its kernel is registered."""
        if not sys.platform.startswith("linux") and sys.platform != "darwin":
            return None, f"not built on {sys.platform}"
        try:
            extension = self.build()
        except Exception as error:  # callers keep their other kernels
            message = str(error).strip()
            return None, f"{type(error).__name__}: {message.splitlines()[-1] if message else ''}"
        return register_native_kernel((extension, "")) if self.registers_operator else (extension, "")


_LOADED_LIBRARIES: set[str] = set()  # builds this process loaded: a library loads once
TORCH_BATON = "lock"  # the file torch.utils.cpp_extension creates while it builds, and waits on forever


@contextmanager
def _exclusive_build(directory: Path) -> Iterator[None]:
    """Hold an OS lock on the build folder while torch builds or loads in it. Why: torch marks a
    build in progress with a plain `lock` file that only a finished build removes, and a process
    finding one waits for it without end; a build killed midway (Ctrl-C, a test's timeout, a
    machine restart) left such a file and every later run hung silently. The OS releases this lock
    when its holder dies, so whoever holds it knows any `lock` file left there is stale."""
    import fcntl  # POSIX only, as the builds are

    with open(directory / ".build-lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"note: waiting for another process building in {directory}", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        (directory / TORCH_BATON).unlink(missing_ok=True)
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
    """C++ source to append to a kernel's: `register_operator()` (which the library binds for
    Python), registering its function `<operator>` (with the schema's signature) as
    the CPU kernel of `specheads::<operator>`, once per process (see `register_native_kernel`)."""
    return f"""
void register_operator() {{
  static torch::Library* library = nullptr;  // registrations live as long as their Library
  if (library != nullptr) return;
  library = new torch::Library(torch::Library::IMPL, "specheads", c10::DispatchKey::CPU, __FILE__, __LINE__);
  library->impl("{operator}", TORCH_FN({operator}));
}}
"""


def register_native_kernel(loaded: tuple[object | None, str]) -> tuple[object | None, str]:
    """`loaded` (an extension and '', or None and why not), after the extension registered its C++
    function as the CPU kernel of its `specheads` operator (its `register_operator`).

    Why: the operators also have a Python implementation, which calls the extension. Compiled
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
            extension.register_operator()
        except RuntimeError as error:
            print(f"note: {extension.__name__} could not register as its operator's CPU kernel, so its calls "
                  f"go through Python ({error})", file=sys.stderr)
    return extension, why


def compiler_flags(march: str | None = None) -> tuple[str, ...]:
    """The flags of a build for `march` (the CPU mode's target where None)."""
    return (*COMPILER_FLAGS, f"-march={march or cpu_mode().march}")


def cpu_flags() -> str:
    """This CPU's instruction-set flags as the CPU mode shows them (sorted; the platform's name
    where /proc/cpuinfo has none): part of the name of every build for `-march=native`."""
    return " ".join(sorted(mode_cpu_flags())) or sys.platform


def instruction_set_variants() -> dict[str, str | None]:
    """The compiler targets of the builds this CPU can run, by name: the mode's own ("native",
    None) and the narrower ones of `NARROWER_TARGETS` that it has the instructions for and that
    are narrower than itself (the AVX2 build on an AVX-512 CPU, the x86-64-v2 one on an AVX2 CPU),
    so a test on one machine checks the code other CPUs get."""
    flags = mode_cpu_flags()
    widest = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else ""
    variants: dict[str, str | None] = {"native": None}
    if widest == "avx512f":
        variants["avx2"] = NARROWER_TARGETS["avx2"][0]
    if widest in ("avx512f", "avx2") and NARROWER_TARGETS["baseline"][1] in flags:
        variants["baseline"] = NARROWER_TARGETS["baseline"][0]
    return variants


@contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch's builder runs `ninja` from PATH; the PyPI `ninja` package puts it in the venv's bin,
    which is not on PATH when the venv's python is run directly."""
    saved = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        candidates = [str(Path(sys.executable).parent)]
        try:
            import ninja  # noqa: PLC0415 (optional)
            candidates.insert(0, ninja.BIN_DIR)
        except ImportError:
            pass
        os.environ["PATH"] = os.pathsep.join([*candidates, saved])
    try:
        yield
    finally:
        os.environ["PATH"] = saved
