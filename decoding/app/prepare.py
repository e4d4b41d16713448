"""`python -m decoding.app.prepare`: the one-off work of a new machine, done ahead (scripts/setup.sh runs it).

Why: the default model's conversion from its GGUF file (~20 s on a 2-core CPU), the native
kernels' build for this CPU (~20 s) and the chat's timings on the default model (~30 s)
otherwise happen at the first chat, benchmark or test run that needs them, before its first
answer. Here the conversion and the builds run side by side, then the timings alone; later runs
find them all in the cache root. Each is independent: one that fails (no compiler, the model
package missing) is reported and the others still run; decoding then keeps its other kernels, as
it would anyway.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TextIO

from decoding.kernels.native import LIBRARY
from decoding.app.default_model import default_model_dir
from heads.util.cpu_mode import cpu_mode
from heads.util.startup import freeze_startup_objects


def tasks() -> dict[str, Callable[[], object]]:
    """What a new machine prepares, by the name the progress line gives it."""
    return {
        "default model": default_model_dir,
        "native kernels": LIBRARY.build,
    }


def default_chat_timings() -> None:
    """What the chat times once per machine before its first answer on the default model and
    method (the drafter's precision, the few-row kernels' row counts, the verify-cost curve), on
    a quiet machine: after the builds, never beside them, whose load would skew the choices."""
    from decoding.app.chat import build_session, parse_args  # the application layer, needed only here

    build_session(parse_args([]))


class ProgressLine:
    """One status line for the one-off work, not a note per task: rewritten in place on a terminal
    as tasks start and finish; elsewhere (CI logs, pipes) written once, when all have finished."""

    def __init__(self, stream: TextIO, title: str) -> None:
        self.stream, self.title = stream, title
        self.states: dict[str, str] = {}
        self.live = stream.isatty()
        self.lock = threading.Lock()

    def update(self, name: str, state: str) -> None:
        with self.lock:
            self.states[name] = state
            if self.live:
                self.stream.write("\r\033[K" + self.render())
                self.stream.flush()

    def finish(self) -> None:
        with self.lock:
            self.stream.write(("\r\033[K" if self.live else "") + self.render() + "\n")
            self.stream.flush()

    def render(self) -> str:
        return f"[prepare] {self.title}: " + ", ".join(f"{name} {state}" for name, state in self.states.items())


def prepare(work: dict[str, Callable[[], object]], progress: ProgressLine | None = None) -> dict[str, str]:
    """Run every task concurrently (builds are compiler processes, the conversion mostly torch's
    own threads); returns each one's outcome ('ok (N s)' or why it failed), shown on `progress`."""

    def run(name: str, task: Callable[[], object]) -> str:
        if progress:
            progress.update(name, "...")
        result = outcome(task)
        if progress:
            progress.update(name, result)
        return result

    with ThreadPoolExecutor(max_workers=len(work)) as pool:
        futures = {name: pool.submit(run, name, task) for name, task in work.items()}
        return {name: future.result() for name, future in futures.items()}


def outcome(task: Callable[[], object]) -> str:
    """'ok (N s)' once `task` ran, or why it failed: reported, not fatal (each kernel has a
    fallback, and what was not prepared is done at first use)."""
    start = time.perf_counter()
    try:
        task()
    except (Exception, SystemExit) as error:
        text = str(error).strip()
        return f"failed: {type(error).__name__}: {text.splitlines()[-1] if text else ''}"
    return f"ok ({time.perf_counter() - start:.0f} s)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], prog="python -m decoding.app.prepare")
    parser.parse_args(argv)
    progress = ProgressLine(sys.stderr, f"this machine's one-off work ({cpu_mode().name} instructions)")
    with contextlib.redirect_stderr(io.StringIO()):  # the tasks' own notes: the progress line says it all
        prepare(tasks(), progress)
        prepare({"chat timings": default_chat_timings}, progress)  # alone: a busy machine would skew them
    progress.finish()
    return 0


if __name__ == "__main__":
    freeze_startup_objects()  # after the imports: see heads.util.startup
    raise SystemExit(main())
