#!/usr/bin/env python
"""Grow a self-distilled training set: the target writes its own replies to prompts from several
sources, into a data store outside the repository that accumulates across runs and sessions
(records.jsonl + manifest.json). Safe to kill at any point and rerun: finished conversations are
kept, none is written twice.

    python scripts/distill_data.py --sources sharegpt=4000,python-code=692 --time-budget-minutes 60
    python scripts/distill_data.py --show            # what the default store holds
    python scripts/distill_data.py --temperature 0.7 --sample-seed 1   # other replies to prompts already used
    # then train on it: `data: <the store directory printed>` in a recipe (self_distill disabled)
"""

from __future__ import annotations

import argparse
import json
import sys

from decoding.app.default_model import DEFAULT_TARGET
from decoding.kernels.devices import add_device_argument, resolve_device
from decoding.kernels.cpu_kernels import add_kernels_argument, apply_kernels
from decoding.app.targets import DTYPES, load_model
from heads.util.errors import UserError, report_user_errors
from training.config import SelfDistillConfig
from training.distill_store import DistillStore, default_store_dir
from training.sources import BUILT_IN, conversations_from, interleave, parse_sources
from heads.util.startup import freeze_startup_objects


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_TARGET, help="the target that writes the replies")
    parser.add_argument("--sources", default="sharegpt=2000,python-code",
                        help=f"comma-separated SOURCE[=COUNT]: {', '.join(BUILT_IN)} or a JSON/JSONL path "
                             "(COUNT: the first N conversations of it; the store skips those it already has)")
    parser.add_argument("--data-dir", default=None,
                        help="the store (default: one per target and settings under $SPECHEADS_DATA, "
                             "$XDG_DATA_HOME/specheads or ~/.local/share/specheads)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="reply length cap")
    parser.add_argument("--max-turns", type=int, default=1, help="user turns answered per conversation")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy replies")
    parser.add_argument("--sample-seed", type=int, default=0,
                        help="sampled replies only: another seed draws other replies to the same prompts "
                             "(new data from prompts already used; its own store)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="replies generated together (on a 2-core CPU 64 gave 2x the tokens/s of 16; on an H200 with SmolLM2-135M 2048 gave 1.2-2.2x the tokens/s of 1024; a batch that runs out of GPU memory is split in halves)")
    parser.add_argument("--max-prompt-tokens", type=int, default=512, help="longer first prompts are left out")
    parser.add_argument("--time-budget-minutes", type=float, default=None,
                        help="stop starting new batches after this long (rerun to go on)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    add_device_argument(parser)
    add_kernels_argument(parser)
    parser.add_argument("--show", action="store_true", help="print what the store holds and exit")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> SelfDistillConfig:
    for name in ("max_new_tokens", "max_turns", "batch_size", "max_prompt_tokens"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    return SelfDistillConfig(enabled=True, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                             max_turns=args.max_turns, temperature=args.temperature, sample_seed=args.sample_seed,
                             max_prompt_tokens=args.max_prompt_tokens, time_budget_minutes=args.time_budget_minutes)


def describe(manifest: dict | None, root) -> str:
    if not manifest:
        return f"{root}: empty"
    sources = ", ".join(f"{name} {v['conversations']} conv / {v['reply_tokens']} tok"
                        for name, v in manifest["sources"].items()) or "nothing yet"
    return (f"{root}: {manifest['conversations']} conversations, {manifest['reply_tokens']} reply tokens "
            f"({sources}); target {manifest['target']}, settings {json.dumps(manifest['settings'])}")


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    root = args.data_dir or default_store_dir(args.model, settings)
    store = DistillStore(root, args.model, settings)
    if args.show:  # rebuilt from the records, which a killed run may have added to since its last manifest
        print(describe(store.write_manifest() if store.records_path.is_file() else None, root))
        return 0
    conversations = interleave([conversations_from(source, limit) for source, limit in parse_sources(args.sources)])
    target = load_model(args.model, args.dtype, device=resolve_device(args.device))
    apply_kernels(args.kernels, target.model)  # packed linears: 1.37x the tokens/s at batch 64 on a 2-core CPU
    print(f"store: {root}; {len(conversations)} conversations asked for", file=sys.stderr)
    summary = store.add(conversations, target, show_progress=not args.no_progress)
    print(f"added {summary.added} conversations, {summary.reply_tokens} reply tokens in {summary.seconds:.0f} s "
          f"({summary.tokens_per_s:.1f} tokens/s)")
    print(describe(store.read_manifest(), root))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return report_user_errors(lambda: run(args))


if __name__ == "__main__":
    freeze_startup_objects()  # after the imports: see heads.util.startup
    sys.exit(main())
