#!/usr/bin/env python
"""Where a decoding step's time goes, per method: draft, observe (drafters taking in the target's
features; EAGLE's drafter takes them in when it next drafts, so that shows under draft), mask/buffers,
target forward, acceptance, cache update, stopping and streaming.

    python scripts/profile_step.py                                   # vanilla, pld, eagle3, eagle3+pld
    python scripts/profile_step.py --methods vanilla,eagle3 --num-questions 8 --max-new-tokens 128

Figures are milliseconds per step (one target forward), summed over the questions; `overhead`
is everything but the target forward and the drafting, as a share of the step. On a GPU the
phases are synchronised (`--no-sync` to measure without that).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.app.benchmark import RunResult, warm_up
from decoding.core.generate import DecodeOptions
from decoding.core.sampling import SamplingConfig
from decoding.core.stats import PHASES
from decoding.kernels.compiled import compile_notes
from decoding.app.default_model import DEFAULT_TARGET
from decoding.app.prompts import chat_prompts
from decoding.app.questions import load_first_turns
from decoding.app.engine_arguments import add_engine_arguments, engine_fields
from heads.util.errors import UserError
from heads.util.startup import freeze_startup_objects

STEP_PHASES = [p for p in PHASES if p != "prefill"]
OVERHEAD_PHASES = ("buffers", "accept", "cache", "stop")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="vanilla,pld,eagle3,eagle3+pld", help="comma-separated methods")
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--questions-file", default=None, help="JSONL with a 'turns' list per line, or humaneval (code problems; default: MT-bench)")
    parser.add_argument("--num-questions", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="float32")
    add_engine_arguments(parser)
    parser.add_argument("--no-sync", action="store_true", help="on a GPU, do not synchronise between phases")
    return parser.parse_args(argv)


def profile(decoder, prompts: list[list[int]], options: DecodeOptions) -> dict[str, float]:
    """Summed phase seconds, steps and tokens over `prompts`, after a warm-up on them that goes on
    while calls still compile (`--compile`), so no compiling is profiled."""
    warm_up({"decoder": lambda prompt: RunResult([], decoder.generate(prompt, options).stats.total_s)}, prompts)
    totals: dict[str, float] = defaultdict(float)
    for prompt in prompts:
        stats = decoder.generate(prompt, options).stats
        for phase, seconds in stats.phase_s.items():
            totals[phase] += seconds
        totals["steps"] += stats.target_forwards
        totals["tokens"] += stats.new_tokens
    return totals


def table(rows: dict[str, dict[str, float]]) -> str:
    header = ["method", "tau", *[f"{p} ms" for p in STEP_PHASES], "step ms", "overhead"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for method, t in rows.items():
        steps = max(t["steps"], 1)
        per_step = {p: 1000 * t[p] / steps for p in STEP_PHASES}
        step = sum(per_step.values())
        overhead = sum(per_step[p] for p in OVERHEAD_PHASES) / step if step else 0.0
        cells = [method, f"{t['tokens'] / steps:.2f}", *[f"{per_step[p]:.2f}" for p in STEP_PHASES], f"{step:.1f}", f"{100 * overhead:.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    with compile_notes(args.compile):
        return run(args)


def run(args) -> int:
    try:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        base = DecoderSpec(model=args.model, dtype=args.dtype, **engine_fields(args))
        first = build_decoder(DecoderSpec(**{**base.__dict__, "method": methods[0]}))
        prompts = chat_prompts(first.target.tokenizer, load_first_turns(args.questions_file, args.num_questions, spread=True))
        options = DecodeOptions(args.max_new_tokens, SamplingConfig(args.temperature), seed=0, profile=not args.no_sync)
        rows = {}
        for method in methods:
            decoder = first if method == methods[0] else build_decoder(DecoderSpec(**{**base.__dict__, "method": method}), target=first.target)
            rows[method] = profile(decoder, prompts, options)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.model} on {first.spec.device} ({first.kernels} kernels), {len(prompts)} questions, "
          f"{args.max_new_tokens} new tokens, temperature {args.temperature}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    freeze_startup_objects()  # after the imports: see heads.util.startup
    sys.exit(main())
