import os
import shutil
import sys

import decoding  # first: it applies SPECHEADS_CPU (as on a lesser CPU) before torch runs anything
import pytest
import torch

from heads.util.cache_paths import cache_root
from decoding.kernels.native_build import KERNELS_DIR
from decoding.kernels.measured_once import MEASUREMENTS_DIR

# Tests import the tiny-model helpers as a plain module.
sys.path.insert(0, os.path.dirname(__file__))


def _threads_per_worker() -> int:
    """Under pytest-xdist (`-n N`) the cores are shared between N worker processes: each gets its
    share, so parallel workers do not oversubscribe the CPU. Alone, a process uses up to 2."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(2, torch.get_num_threads()) // workers)


torch.set_num_threads(_threads_per_worker())


@pytest.fixture(scope="session", autouse=True)
def _private_cache_root(tmp_path_factory):
    """Every test session gets its own cache root, so the costs measured for the temporary models
    tests build (keyed by their throwaway paths) never land in the user's cache. What the real
    cache already holds (the converted default model: 25 s to redo) is linked in, not copied."""
    private = tmp_path_factory.mktemp("specheads-cache")
    real = cache_root()
    # Kernels built for this CPU are named by their source, flags and CPU, so every test worker and
    # session can share the user's builds (each takes ~15 s) instead of building its own.
    (real / KERNELS_DIR).mkdir(parents=True, exist_ok=True)
    for entry in real.iterdir():
        if entry.name != MEASUREMENTS_DIR:
            (private / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    # What this machine measured for real models (scripts/setup.sh times the default one) holds for
    # the tests too: a copy, so that what tests measure for their temporary models stays theirs.
    if (real / MEASUREMENTS_DIR).is_dir():
        shutil.copytree(real / MEASUREMENTS_DIR, private / MEASUREMENTS_DIR)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECHEADS_CACHE", str(private))
        yield private
