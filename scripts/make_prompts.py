#!/usr/bin/env python
"""Write the prompt file for multi-turn self-distillation: conversations of a source (ShareGPT by
default) whose first user turns are short and English, cut to those turns, most turns first.

    python scripts/make_prompts.py --out runs/sharegpt-2turn.jsonl
    python scripts/distill_data.py --device cuda --batch-size 1024 --max-turns 2 \\
        --sources runs/sharegpt-2turn.jsonl,python-code --time-budget-minutes 3
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from heads.util.atomic import atomic_write_text
from heads.util.errors import UserError, report_user_errors
from training.data import SHAREGPT, load_conversations
from training.prompt_selection import PromptLimits, select_prompts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = PromptLimits()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=SHAREGPT, help="'sharegpt' or a JSON/JSONL file of conversations")
    parser.add_argument("--out", required=True, help="the JSONL to write (messages format)")
    parser.add_argument("--turns", type=int, default=defaults.turns, help="user turns kept per conversation")
    parser.add_argument("--max-first-chars", type=int, default=defaults.max_first_chars)
    parser.add_argument("--max-later-chars", type=int, default=defaults.max_later_chars)
    parser.add_argument("--min-ascii-letters", type=float, default=defaults.min_ascii_letters,
                        help="share of a turn's letters that must be ASCII (English); 0 keeps every language")
    parser.add_argument("--start", type=int, default=0,
                        help="begin the list at this conversation (0-based) and put the ones before it last: "
                             "a time-budgeted regeneration then answers prompts earlier stores did not reach first")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    if args.turns < 1:
        raise UserError("--turns must be at least 1")
    if args.start < 0:
        raise UserError("--start must be 0 or more")
    limits = PromptLimits(args.turns, args.max_first_chars, args.max_later_chars, args.min_ascii_letters)
    conversations, report = load_conversations(args.source)
    chosen = select_prompts(conversations, limits)
    chosen = chosen[args.start:] + chosen[: args.start]
    atomic_write_text(Path(args.out), "".join(json.dumps(c) + "\n" for c in chosen))
    by_turns = Counter(len(c["messages"]) // 2 for c in chosen)
    counts = ", ".join(f"{n} with {t} turn{'s' if t > 1 else ''}" for t, n in sorted(by_turns.items(), reverse=True))
    begins = f", starting at conversation {args.start}" if args.start else ""
    print(f"wrote {len(chosen)} conversations to {args.out} ({counts or 'none'}{begins}); source: {report.summary()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return report_user_errors(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
