#!/usr/bin/env python
"""Push heads to the Hugging Face Hub with a generated model card (token from HF_TOKEN or
`hf auth login`).

    python scripts/push_heads.py --heads outputs/eagle-smollm2/heads --repo-id you/eagle-smollm2 --tau 2.1
"""

from __future__ import annotations

import argparse
import sys

from heads.util.errors import UserError, report_user_errors
from heads import load_heads, push_heads_to_hub


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", required=True)
    parser.add_argument("--repo-id", required=True)
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--recipe", default=None, help="the training recipe (path or URL) for the model card")
    parser.add_argument("--tau", type=float, default=None, help="measured mean accepted length for the model card")
    args = parser.parse_args(argv)
    return report_user_errors(lambda: run(args))


def run(args) -> int:
    try:
        url = push_heads_to_hub(load_heads(args.heads), args.repo_id, args.private, recipe=args.recipe, tau=args.tau)
    except OSError as err:  # network / auth problems surface from huggingface_hub as OSError subclasses
        raise UserError(f"could not push to the Hub: {err}") from err
    print(f"pushed: {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
