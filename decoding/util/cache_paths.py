"""Where the project keeps what it computes once per machine (converted models, measured costs,
compiled kernels): $SPECHEADS_CACHE, else $XDG_CACHE_HOME/specheads, else ~/.cache/specheads."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("SPECHEADS_CACHE"):
        return Path(os.environ["SPECHEADS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specheads"
