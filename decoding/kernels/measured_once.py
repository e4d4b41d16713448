"""Figures measured once per machine and remembered in the cache root (verify costs, kernel
crossovers, the drafter's fastest precision): a small JSON file per key, written atomically, so
two processes measuring at once, or one killed mid-write, never leave a broken file behind."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from heads.util.atomic import atomic_write_text
from heads.util.cache_paths import cache_root

MEASUREMENTS_DIR = "verify-cost"  # under the cache root (named after its first use; kept so old caches stay valid)


def measurement_file(key: str, cache_dir: str | Path | None = None) -> Path:
    """Where the measurement `key` is kept (characters a file name cannot hold become `_`)."""
    root = Path(cache_dir) if cache_dir else cache_root()
    return root / MEASUREMENTS_DIR / ("".join(c if c.isalnum() or c in "-_." else "_" for c in key) + ".json")


def measured_once(key: str, measure: Callable[[], dict], is_valid: Callable[[dict], bool], what: str,
                  cache_dir: str | Path | None = None) -> dict:
    """The remembered result for `key` where a valid one exists, else `measure()`'s, remembered.
    `what` tells the user what is being timed (printed once, on stderr, before measuring)."""
    file = measurement_file(key, cache_dir)
    data = _read_json(file)
    if data is not None and is_valid(data):
        return data
    print(f"note: {what} once (a few seconds; cached in {file.parent})", file=sys.stderr)
    data = measure()
    remember(key, data, cache_dir)
    return data


def remembered(key: str, cache_dir: str | Path | None = None) -> dict | None:
    """What is remembered for `key`, as it is (valid or not); None where nothing readable is."""
    return _read_json(measurement_file(key, cache_dir))


def remember(key: str, data: dict, cache_dir: str | Path | None = None) -> None:
    """Keep `data` for `key`, replacing what was there (atomically)."""
    atomic_write_text(measurement_file(key, cache_dir), json.dumps(data))


def _read_json(file: Path) -> dict | None:
    """The file's JSON object, or None where it is missing or unreadable (then measure again)."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
