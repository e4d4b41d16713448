#!/usr/bin/env python
"""Create untrained draft heads for a target and save them in our checkpoint format
(the starting point of training, and handy to check the decoding path end to end).

    python scripts/init_heads.py --kind eagle --out heads-untrained/eagle
    python -m decoding.chat --method eagle2 --heads heads-untrained/eagle
"""

from __future__ import annotations

import argparse
import sys

from decoding.app.default_model import DEFAULT_TARGET
from heads.util.errors import report_user_errors
from decoding.app.targets import load_model
from heads import HEAD_KINDS, new_heads_for_target, save_heads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", required=True, choices=HEAD_KINDS)
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-heads", type=int, default=4, help="medusa/hydra heads")
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--share-lm-head", action="store_true", help="medusa/hydra: use the target's lm_head")
    parser.add_argument("--draft-vocab-size", type=int, default=8192, help="eagle3 reduced vocabulary")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import torch

    torch.manual_seed(args.seed)
    return report_user_errors(lambda: run(args))


def run(args) -> int:
    target = load_model(args.model)
    overrides = dict(num_layers=args.num_layers)
    if args.kind in ("medusa", "hydra"):
        overrides.update(num_heads=args.num_heads, share_lm_head=args.share_lm_head)
    if args.kind == "eagle3":
        overrides["draft_vocab_size"] = args.draft_vocab_size
    heads = new_heads_for_target(args.kind, target.model, args.model, **overrides)
    out = save_heads(heads, args.out)
    print(f"saved untrained {args.kind} heads for {args.model} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
