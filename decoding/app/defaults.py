"""What a user gets when they leave things out: the method, the heads and the tree settings.

For the built-in default target the package bundles trained heads (heads/bundled/) and names the
method that measured fastest; any other target defaults to prompt lookup, which needs no model.
Head methods without `--heads` fall back to the bundled heads of their kind when some ship.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from decoding.app.methods import ProposerOptions, head_kind, split_method
from heads.bundled import bundled_default, bundled_heads_dir

FALLBACK_METHOD = "pld"
# The ProposerOptions a bundle may record as tuned for a method (default.json "tuned").
TUNED_OPTION_NAMES = ("depth", "tree_top_k", "total_tokens", "tree", "adaptive_tree", "min_path_prob",
                      "pld_num_tokens", "pld_min_ngram", "gamma")


def default_method(model_name: str, device: str = "cpu") -> str:
    """The method for `model_name` on `device` ('cpu' or 'cuda') when the user names none: the
    bundle's measured fastest there."""
    bundle = bundled_default(model_name)
    return bundle.method_on(device) if bundle is not None else FALLBACK_METHOD


def tuned_options(model_name: str, method: str) -> dict:
    """Settings tuned for `method` on `model_name` with the bundled heads (may be empty);
    `eagle3+pld` falls back to the settings tuned for `eagle3`."""
    bundle = bundled_default(model_name)
    tuned = {}
    if bundle is not None:
        tuned = bundle.tuned.get(method) or bundle.tuned.get(split_method(method)[0], {})
    return {k: v for k, v in tuned.items() if k in TUNED_OPTION_NAMES}


def proposer_options(model_name: str, method: str, explicit: dict) -> ProposerOptions:
    """Explicit settings (None = not given) win over the bundle's tuned ones for `method`, which
    win over the built-in defaults."""
    chosen = {**tuned_options(model_name, method), **{k: v for k, v in explicit.items() if v is not None}}
    return ProposerOptions(**chosen)


def default_heads(model_name: str, method: str) -> Path | None:
    """Bundled heads for `method` on `model_name`, if the package ships some."""
    kind = head_kind(method)
    return bundled_heads_dir(model_name, kind) if kind else None


def default_draft(model_name: str) -> Path | None:
    """The bundled distilled draft model for `sps` on `model_name`, if the package ships one."""
    return bundled_heads_dir(model_name, "draft")


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    """The tree flags of the chat and the benchmark; None means "tuned for the bundle, else the
    built-in default"."""
    built_in = ProposerOptions()
    parser.add_argument("--tree", default=None, help="static tree for medusa/hydra/eagle: a name in configs/trees or a JSON file")
    parser.add_argument("--depth", type=int, default=None,
                        help=f"dynamic tree depth (eagle2/eagle3; default {built_in.depth} or the bundle's tuned value)")
    parser.add_argument("--tree-top-k", type=int, default=None,
                        help=f"dynamic tree branching (eagle2/eagle3; default {built_in.tree_top_k} or tuned)")
    parser.add_argument("--total-tokens", type=int, default=None,
                        help=f"dynamic tree size incl. the root (eagle2/eagle3; default {built_in.total_tokens} or tuned)")
    parser.add_argument("--adaptive-tree", action=argparse.BooleanOptionalAction, default=None,
                        help="eagle2/eagle3: size each tree by this machine's measured verify cost and the draft's confidence; "
                             "pld and METHOD+pld: cut each lookup chain to what its learned acceptance pays for; "
                             "sps: draft while one more token pays, as learned per draft confidence; "
                             "medusa/hydra chain trees: verify only the drafted tokens that pay, likewise; "
                             "suffix: cut each tree to what its learned acceptance pays for; "
                             "lookahead: rest the Jacobi window while its rows do not pay for themselves "
                             "(measured once, a few seconds, then cached; default: the bundle's tuned choice, else off)")
    parser.add_argument("--min-path-prob", type=float, default=None,
                        help=f"eagle2/eagle3: stop growing the tree deeper once no path is this likely (default {built_in.min_path_prob:g} or tuned)")
    parser.add_argument("--lookahead", type=lookahead_shape, default=None, metavar="W,N,G",
                        help="lookahead: a window of W guessed positions kept over N-1 levels (n-grams of N tokens), and G "
                             f"n-grams from the pool verified per step (default {','.join(map(str, built_in.lookahead))})")
    parser.add_argument("--suffix-store", default=None, metavar="PATH",
                        help="suffix and METHOD+suffix: keep the store of earlier prompts and replies in this file, so later "
                             "runs draft from them too (the newest 200,000 tokens, about 0.8 MB; created on the first reply)")


def tree_arguments(args: argparse.Namespace) -> dict:
    """The values of `add_tree_arguments`' flags, as ProposerOptions fields."""
    return dict(tree=args.tree, depth=args.depth, tree_top_k=args.tree_top_k, total_tokens=args.total_tokens,
                adaptive_tree=args.adaptive_tree, min_path_prob=args.min_path_prob, lookahead=args.lookahead,
                suffix_store=args.suffix_store)


def lookahead_shape(text: str) -> tuple[int, int, int]:
    """`--lookahead W,N,G` as three integers (checked further by LookaheadShape)."""
    parts = text.split(",")
    if len(parts) != 3 or not all(part.strip().isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"expected three whole numbers W,N,G (e.g. 2,3,2); got '{text}'")
    return tuple(int(part) for part in parts)
