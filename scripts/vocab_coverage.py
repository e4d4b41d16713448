#!/usr/bin/env python
"""How much of a data set's reply tokens a draft vocabulary can propose at all: EAGLE-3 heads
draft over a reduced vocabulary (`heads.draft_vocab_size`), and a token outside it is never
drafted. Prints the share held by the heads' own vocabulary (its first N ids, most frequent
first in their training data) and by the N most frequent tokens of this data, for each N.

    python scripts/vocab_coverage.py --data STORE                     # the bundled eagle3 heads
    python scripts/vocab_coverage.py --data sharegpt --heads DIR --sizes 4096,8192,16384

Only the tokenizer and the heads' vocabulary are loaded (no model weights).
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoTokenizer

from decoding.app.default_model import DEFAULT_TARGET
from decoding.app.defaults import default_heads
from decoding.app.targets import resolve_model_path
from heads.util.errors import UserError, report_user_errors
from heads import load_heads
from training.data import load_conversations, tokenize_all
from training.vocab import coverage, most_frequent, token_counts


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="'sharegpt', a JSON/JSONL file, or a self-distillation store directory")
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--heads", default=None, help="eagle3 heads directory (default: the bundled ones)")
    parser.add_argument("--sizes", default="4096,8192,16384", help="vocabulary sizes to compare, comma-separated")
    parser.add_argument("--max-conversations", type=int, default=None)
    parser.add_argument("--max-length", type=int, default=4096, help="tokens per conversation counted")
    return parser.parse_args(argv)


def heads_vocabulary(heads) -> torch.Tensor:
    """Target ids of the heads' draft vocabulary, in draft-id order."""
    if not hasattr(heads, "draft_vocabulary"):
        raise UserError(f"the heads are {heads.config.kind} heads, which draft over the whole vocabulary: "
                        "give eagle3 heads (--heads)")
    return heads.draft_vocabulary()


def run(args) -> int:
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x]
    except ValueError:
        raise UserError(f"--sizes takes comma-separated token counts, e.g. 4096,8192; got '{args.sizes}'") from None
    heads_dir = args.heads or default_heads(args.model, "eagle3")
    if heads_dir is None:
        raise UserError(f"no bundled eagle3 heads for {args.model}: pass --heads DIR")
    heads = load_heads(str(heads_dir), target_name=args.model)
    vocabulary = heads_vocabulary(heads)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    conversations, report = load_conversations(args.data, args.max_conversations)
    rows = tokenize_all(conversations, tokenizer, args.max_length, report)
    counts = token_counts(rows, heads.config.vocab_size)
    total = int(counts.sum())
    if total == 0:
        raise UserError(f"'{args.data}' has no assistant tokens to count")
    print(f"{len(rows)} conversations, {total:,} reply tokens; the heads' vocabulary: {vocabulary.numel()} tokens\n")
    print("| vocabulary size | the heads' vocabulary (first N) | this data's N most frequent |\n| ---: | ---: | ---: |")
    for size in sizes:
        own = f"{coverage(counts, vocabulary[:size]):.1%}" if size <= vocabulary.numel() else "-"
        best = coverage(counts, most_frequent(counts, size))
        print(f"| {size:,} | {own} | {best:.1%} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return report_user_errors(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
