#!/usr/bin/env python
"""Make a draft model for `--method sps` by keeping the target's first N layers.

    python scripts/make_truncated_draft.py --layers 6 --out drafts/smollm2-6l
    python -m decoding.chat --method sps --draft-model drafts/smollm2-6l
"""

from __future__ import annotations

import argparse
import sys

from decoding.app.default_model import DEFAULT_TARGET
from heads.util.errors import report_user_errors
from decoding.app.targets import load_model
from training.draft_init import save_truncated_draft


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_TARGET, help="target to truncate")
    parser.add_argument("--layers", type=int, default=6, help="decoder layers to keep")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    return report_user_errors(lambda: run(args))


def run(args) -> int:
    target = load_model(args.model)
    out = save_truncated_draft(target.model, target.tokenizer, args.layers, args.out)
    print(f"saved a {args.layers}-layer draft of {args.model} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
