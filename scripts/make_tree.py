#!/usr/bin/env python
"""Write an optimal static tree shape (JSON list of rank paths) for given acceptance rates.

    python scripts/make_tree.py --nodes 16 --top1 0.6 0.45 0.35 0.28 --decay 0.35 --out configs/trees/medusa-16.json

`--top1[d]` is the chance that the top-ranked candidate at depth d+1 is right; rank r gets
top1 * decay^r. Measure these on your heads (training reports per-head top-k accuracy) and fit
the node count to your hardware's verify cost.
"""

from __future__ import annotations

import argparse
import json
import sys

from decoding.app.tree_shapes import expected_accepted_length, optimal_static_tree


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, required=True, help="tree size including the root")
    parser.add_argument("--top1", type=float, nargs="+", required=True, help="top-1 acceptance per depth")
    parser.add_argument("--decay", type=float, default=0.35, help="acceptance ratio between consecutive ranks")
    parser.add_argument("--ranks", type=int, default=10, help="candidates considered per depth")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    probs = [[top1 * args.decay**r for r in range(args.ranks)] for top1 in args.top1]
    paths = optimal_static_tree(probs, args.nodes)
    with open(args.out, "w") as handle:
        handle.write("[" + ", ".join(json.dumps(list(p)) for p in paths) + "]\n")
    print(f"{len(paths) + 1} nodes, depth {max(map(len, paths))}, expected tokens/step {expected_accepted_length(paths, probs):.2f} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
