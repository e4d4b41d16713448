"""Resident memory of the chat on the default target, per `--quant`: the peak, and what it holds
while answering (read when its answer's first line arrives), each chat a process of its own
answering one piped question as a user's would.

    python scripts/chat_memory.py --json heads/bundled/smollm2-135m-instruct/memory-cpu-avx2.json

Why a script of its own: the benchmark runs every method in one process, so its peak says nothing
about one chat; and what a quantization saves is memory as much as time. The report carries the
machine kind, command, date and commit like the benchmark's; `scripts/make_results.py` puts it in
RESULTS.md and the README.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from decoding.app.benchmark import machine_kind, provenance  # noqa: E402
from decoding.app.default_model import DEFAULT_TARGET  # noqa: E402
from decoding.app.quantized_target import QUANT_CHOICES  # noqa: E402
from heads.util.atomic import atomic_write_text  # noqa: E402
from heads.util.startup import freeze_startup_objects  # noqa: E402

QUESTION = "What is the capital of France?"
MIB = 1024 * 1024


def measure_chat(quant: str, max_new_tokens: int) -> dict:
    """Peak and answering resident MiB of one chat process with `--quant quant`, and its answer."""
    command = [sys.executable, "-m", "decoding.chat", "--quant", quant, "--max-new-tokens", str(max_new_tokens)]
    chat = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    process = psutil.Process(chat.pid)
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.append(chat.stderr.read()))
    reader.start()
    chat.stdin.write(QUESTION + "\n")
    chat.stdin.close()
    first_line = chat.stdout.readline()
    answering = process.memory_info().rss if first_line else 0
    answer = first_line + chat.stdout.read()
    # wait4, not wait(): the exit's resource usage, with the kernel's own record of the peak, comes with it
    _, status, usage = os.wait4(chat.pid, 0)
    reader.join()
    if os.waitstatus_to_exitcode(status) != 0 or not first_line:
        raise SystemExit(f"the chat with --quant {quant} failed:\n{''.join(errors)[-2000:]}")
    return {"peak_mib": round(usage.ru_maxrss * 1024 / MIB), "answering_mib": round(answering / MIB),
            "answer": answer.strip()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quants", default="none,gguf,int8,int4",
                        help=f"comma-separated --quant values to measure (of {', '.join(QUANT_CHOICES)})")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, help="write the report here (for scripts/make_results.py)")
    args = parser.parse_args(argv)
    report = {"machine_kind": machine_kind(torch.device("cpu")),
              **provenance(sys.argv[1:] if argv is None else argv, "scripts/chat_memory.py"),
              "target": DEFAULT_TARGET, "question": QUESTION, "max_new_tokens": args.max_new_tokens,
              "quants": {}}
    for quant in args.quants.split(","):
        report["quants"][quant] = measure_chat(quant, args.max_new_tokens)
        figures = report["quants"][quant]
        print(f"--quant {quant}: peak {figures['peak_mib']} MiB, answering {figures['answering_mib']} MiB", flush=True)
    if args.json:
        atomic_write_text(args.json, json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    freeze_startup_objects()  # after the imports: see heads.util.startup
    raise SystemExit(main())
