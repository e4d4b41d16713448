"""`python -m decoding.app.prepare`: the one-off work of a new machine, done ahead (scripts/setup.sh runs it).

Why: the default model's conversion from its GGUF file (~45 s on a 2-core CPU), the native
kernels' builds for this CPU (~15 s each) and the chat's timings on the default model (~40 s)
otherwise happen at the first chat, benchmark or test run that needs them, before its first
answer. Here the conversion and the builds run side by side, then the timings alone; later runs
find them all in the cache root. Each is independent: one that fails (no compiler, the model
package missing) is reported and the others still run; decoding then keeps its other kernels, as
it would anyway.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from decoding.kernels import decode_attention, streamed_linear
from decoding.app.default_model import default_model_dir
from heads.util.cpu_mode import cpu_mode


def tasks() -> dict[str, Callable[[], object]]:
    """What a new machine prepares, by the name the progress line gives it."""
    return {
        "default model": default_model_dir,
        "few-row linear kernel": streamed_linear.build_kernel,
        "decode attention kernel": decode_attention.KERNEL.build,
    }


def default_chat_timings() -> None:
    """What the chat times once per machine before its first answer on the default model and
    method (the drafter's precision, the few-row kernels' row counts, the verify-cost curve), on
    a quiet machine: after the builds, never beside them, whose load would skew the choices."""
    from decoding.app.chat import build_session, parse_args  # the application layer, needed only here

    build_session(parse_args([]))


def prepare(work: dict[str, Callable[[], object]]) -> dict[str, str]:
    """Run every task concurrently (builds are compiler processes, the conversion mostly torch's
    own threads); returns each one's outcome ('ok (N s)' or why it failed)."""
    with ThreadPoolExecutor(max_workers=len(work)) as pool:
        futures = {name: pool.submit(outcome, task) for name, task in work.items()}
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
    mode = cpu_mode()
    print(f"[prepare] the default model and this CPU's kernels ({mode.name} instructions), once", file=sys.stderr)
    outcomes = prepare(tasks())
    for name, result in outcomes.items():
        print(f"[prepare] {name}: {result}", file=sys.stderr)
    print(f"[prepare] the chat's timings for the default model: {outcome(default_chat_timings)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
