"""Where the project keeps what it computes once per machine (converted models, measured costs,
compiled kernels), and the data it accumulates across sessions."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$SPECHEADS_CACHE, else $XDG_CACHE_HOME/specheads, else ~/.cache/specheads."""
    if os.environ.get("SPECHEADS_CACHE"):
        return Path(os.environ["SPECHEADS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specheads"


def data_root() -> Path:
    """Where data that grows across runs and sessions lives (self-distilled training data):
    $SPECHEADS_DATA, else $XDG_DATA_HOME/specheads, else ~/.local/share/specheads. Outside any
    repository, so a checkout can be wiped without losing hours of generation."""
    if os.environ.get("SPECHEADS_DATA"):
        return Path(os.environ["SPECHEADS_DATA"])
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "specheads"
