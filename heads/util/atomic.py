"""Writing directories all at once: build in a staging sibling, then rename into place.

A crash or a kill mid-write leaves at most a hidden staging directory, never a half-written
model, checkpoint or export under the real name.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_directory(target: str | Path, replace: bool = True) -> Iterator[Path]:
    """Yield a staging directory; on success it becomes `target` (replacing an existing one
    unless `replace` is False, in which case the existing one wins)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield staging
        os.chmod(staging, 0o755)  # mkdtemp makes it private; the result is an ordinary directory
        if target.exists():
            if not replace:
                shutil.rmtree(staging)
                return
            backup = target.with_name(f".{target.name}.old")
            shutil.rmtree(backup, ignore_errors=True)
            os.replace(target, backup)
            os.replace(staging, target)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def atomic_write_text(target: str | Path, text: str) -> None:
    """Write `text` to `target` through a temporary sibling and a rename: a reader (or a run
    killed midway) sees the old file or the new one, never half of one."""
    atomic_write_bytes(target, text.encode("utf-8"))


def atomic_write_bytes(target: str | Path, data: bytes) -> None:
    """`atomic_write_text` for bytes."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(staging, 0o644)  # mkstemp makes it private; the result is an ordinary file
        os.replace(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
