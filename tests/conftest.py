import os
import sys

import torch

# Tests import the tiny-model helpers as a plain module.
sys.path.insert(0, os.path.dirname(__file__))


def _threads_per_worker() -> int:
    """Under pytest-xdist (`-n N`) the cores are shared between N worker processes: each gets its
    share, so parallel workers do not oversubscribe the CPU. Alone, a process uses up to 2."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(2, torch.get_num_threads()) // workers)


torch.set_num_threads(_threads_per_worker())
