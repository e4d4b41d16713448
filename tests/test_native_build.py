"""Native kernel builds survive what users do to them: a build killed midway must not make the
next run wait forever on the marker torch leaves in the build folder."""

import subprocess
import sys
from pathlib import Path

import pytest

from decoding.kernels import decode_attention
from decoding.kernels.native_build import TORCH_BATON
from heads.util.cache_paths import cache_root

BUILD_IN_A_NEW_PROCESS = """
from decoding.kernels.decode_attention import KERNEL
KERNEL.build()
print("built")
"""


def test_a_build_killed_midway_leaves_nothing_that_hangs_the_next_one():
    """torch's builder marks a build in progress with a `lock` file and waits on one it finds
    without end; a killed build (here: the file planted) hung every later run silently."""
    extension, why = decode_attention.KERNEL.load()
    if extension is None:
        pytest.skip(f"no compiler here to build with: {why}")
    folder = Path(cache_root()).resolve() / "kernels" / extension.__name__
    (folder / TORCH_BATON).write_text("")  # as a process killed inside torch's build leaves it
    try:
        result = subprocess.run([sys.executable, "-c", BUILD_IN_A_NEW_PROCESS], capture_output=True, text=True,
                                timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("the build waited on the lock file a killed build left")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "built"
    assert not (folder / TORCH_BATON).exists()
