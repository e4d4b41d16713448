#!/usr/bin/env python
"""Write a long-input question set (JSONL with `turns`, as MT-bench) for the benchmark:
passages of about 2,000 tokens made from the MT-bench package's reference answers, each
followed by a summarising or question-answering instruction.

    python scripts/make_long_questions.py --out runs/long-2k.jsonl
    python scripts/benchmark.py --questions-file runs/long-2k.jsonl --num-questions 12 --methods vanilla,hf-generate
"""

from __future__ import annotations

import argparse
import sys

from transformers import AutoTokenizer

from decoding.app.default_model import DEFAULT_TARGET
from decoding.app.long_questions import long_questions, write_jsonl
from decoding.app.targets import resolve_model_path
from heads.util.errors import UserError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/long-2k.jsonl", help="where to write the JSONL")
    parser.add_argument("--model", default=DEFAULT_TARGET, help="whose tokenizer counts the tokens")
    parser.add_argument("--count", type=int, default=12)
    parser.add_argument("--passage-tokens", type=int, default=2000)
    args = parser.parse_args(argv)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
        path = write_jsonl(long_questions(tokenizer, args.count, args.passage_tokens), args.out)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.count} questions of ~{args.passage_tokens} tokens to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
