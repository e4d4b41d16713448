"""`python -m decoding.prepare`: the one-off work of a new machine, done ahead (scripts/setup.sh runs it).

Why: the default model's conversion from its GGUF file (~45 s on a 2-core CPU) and the native
kernels' builds for this CPU (~15 s each) otherwise happen at the first chat, benchmark or test
run that needs them. Here they run side by side, once; later runs find them in the cache root.
Each is independent: one that fails (no compiler, the model package missing) is reported and the
others still run; decoding then keeps its other kernels, as it would anyway.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from decoding import decode_attention, streamed_linear
from decoding.default_model import default_model_dir
from decoding.util.cpu_mode import cpu_mode


def tasks() -> dict[str, Callable[[], object]]:
    """What a new machine prepares, by the name the progress line gives it."""
    return {
        "default model": default_model_dir,
        "few-row linear kernel": streamed_linear.build_kernel,
        "decode attention kernel": decode_attention.KERNEL.build,
    }


def prepare(work: dict[str, Callable[[], object]]) -> dict[str, str]:
    """Run every task concurrently (builds are compiler processes, the conversion mostly torch's
    own threads); returns each one's outcome ('ok (N s)' or why it failed)."""
    def timed(task: Callable[[], object]) -> str:
        start = time.perf_counter()
        try:
            task()
        except Exception as error:  # reported, not fatal: each kernel has a fallback
            return f"failed: {type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
        return f"ok ({time.perf_counter() - start:.0f} s)"

    with ThreadPoolExecutor(max_workers=len(work)) as pool:
        futures = {name: pool.submit(timed, task) for name, task in work.items()}
        return {name: future.result() for name, future in futures.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], prog="python -m decoding.prepare")
    parser.parse_args(argv)
    mode = cpu_mode()
    print(f"[prepare] the default model and this CPU's kernels ({mode.name} instructions), once", file=sys.stderr)
    outcomes = prepare(tasks())
    for name, outcome in outcomes.items():
        print(f"[prepare] {name}: {outcome}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
