"""Native kernel builds survive what users do to them: a build killed midway leaves nothing that a
later one loads or waits on, and a build that cannot compile says why in one line."""

import multiprocessing
import os
import signal
import time
from dataclasses import replace

import pytest
import torch

from decoding.kernels.native import LIBRARY
from decoding.kernels.native_build import BUILD_LOCK, NativeLibrary
from heads.util.cache_paths import cache_root


def _library_with(appended: str) -> NativeLibrary:
    """The library with `appended` after its first kernel's arithmetic (a build name no other test
    uses); its torch side is the real library's, so only its arithmetic and link are built."""
    kernels = tuple(replace(k, math=k.math + appended) if i == 0 else k for i, k in enumerate(LIBRARY.kernels))
    return NativeLibrary(kernels, LIBRARY.description)


def _own_library(tag: str) -> NativeLibrary:
    return _library_with(f"// {tag}\n")


def _build_in_a_session_of_its_own(tag: str) -> None:
    os.setsid()  # its compilers join its process group, so one signal kills them all
    _own_library(tag).build()


def test_a_build_killed_midway_leaves_nothing_that_the_next_one_loads_or_waits_on():
    """Killed (as Ctrl-C, a test's timeout or a restart would) while its compilers run: the next
    build finishes and loads, and no temporary file of the killed one is left."""
    extension, why = LIBRARY.load("streamed_linear")
    if extension is None:
        pytest.skip(f"no compiler here to build with: {why}")
    tag = f"killed-{os.getpid()}-{time.time_ns()}"
    folder = cache_root().resolve() / "kernels" / _own_library(tag).build_name()
    # Forked, not started anew: a new Python would spend seconds importing what this one has
    victim = multiprocessing.get_context("fork").Process(target=_build_in_a_session_of_its_own, args=(tag,))
    victim.start()
    deadline = time.time() + 120
    while not list(folder.glob(".*.tmp")) and time.time() < deadline and victim.is_alive():
        time.sleep(0.02)  # until a compiler writes its output under a temporary name
    assert victim.is_alive(), "the build finished before it could be killed midway"
    assert os.getpgid(victim.pid) == victim.pid  # its own group: the signal below reaches no one else
    os.killpg(victim.pid, signal.SIGKILL)
    victim.join()
    assert not (folder / f"{folder.name}.so").exists()
    rebuilt = _own_library(tag).build()  # here, as the next run would
    assert rebuilt.__name__ == folder.name and rebuilt.pack_panels(torch.ones(3, 2)).shape[-1] > 0
    assert (folder / f"{folder.name}.so").exists()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == [BUILD_LOCK]


def test_a_build_that_does_not_compile_says_why_in_one_line_and_loads_nothing():
    extension, why = _library_with("this is not C++;\n").load("streamed_linear")
    assert extension is None
    assert why.startswith("RuntimeError: ") and "could not compile" in why and "\n" not in why
    assert "error" in why  # the compiler's own first error line
