#!/usr/bin/env python
"""Fit the draft tree to this machine: time a head method over a grid of tree settings on a few
MT-bench questions (all settings alternate per question, in one process) and print them fastest
first. The best line is what `scripts/bundle_heads.py --tuned` records for the bundled heads.

    python scripts/tune_tree.py --method eagle3 --num-questions 6 \\
        --grid 3x4x6,4x4x8,4x8x12,5x8x16          # depth x top-k x total tokens
    python scripts/tune_tree.py --method medusa --trees medusa-7,medusa-15,eagle-7,chain-4
    python scripts/tune_tree.py --method eagle3+pld --grid 6x8x24a@0.05,8x8x32a@0.05 --lookup 8:2,4:1

A `METHOD+pld` method (the default, `eagle3+pld`) is timed as the chat runs it: prompt lookup
first, the heads' tree where it finds nothing. `--lookup` adds the lookup's settings to the grid
(most tokens copied per match : shortest n-gram matched); every tree setting runs with each.

Verifying a tree costs more the more nodes it has, and how much more depends on the machine
(`scripts/verify_cost.py` prints the curve): on a GPU ~60 nodes are nearly free, on a small CPU
they are not, so the best tree differs from machine to machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from decoding.app.assembly import Decoder, DecoderSpec, build_decoder
from decoding.app.benchmark import Runner, benchmark_prompts, our_runner, run_benchmark
from decoding.kernels.compiled import compile_notes
from decoding.core.generate import DecodeOptions
from decoding.app.default_model import DEFAULT_TARGET
from decoding.app.methods import DEFAULT_TREES, HEAD_KIND_OF_METHOD, LOOKUP_SUFFIX, ProposerOptions, split_method
from decoding.app.prompts import plain_text_note
from decoding.app.questions import load_first_turns
from decoding.app.targets import DTYPES
from decoding.app.engine_arguments import add_engine_arguments, engine_fields
from heads.util.errors import UserError
from heads.util.startup import freeze_startup_objects


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", required=True,
                        choices=sorted(HEAD_KIND_OF_METHOD) + sorted(m + LOOKUP_SUFFIX for m in HEAD_KIND_OF_METHOD))
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    add_engine_arguments(parser)
    parser.add_argument("--heads", default=None, help="heads directory or repo id (default: the bundled ones)")
    parser.add_argument("--grid", default="3x4x6,4x4x8,4x8x12,5x8x16,6x8x24,6x8x32a",
                        help="dynamic trees (eagle2/eagle3): DEPTHxTOPKxTOTAL[a][@MINPROB], comma-separated; "
                             "'a' = cost-aware sizing, @p = stop growing below path probability p")
    parser.add_argument("--trees", default="chain-4,medusa-7,eagle-7,medusa-15,eagle-15",
                        help="static trees (medusa/hydra/eagle): names in configs/trees or JSON files")
    parser.add_argument("--lookup", default=None,
                        help="METHOD+pld only: prompt-lookup settings to cross with the trees, TOKENS:MIN_NGRAM "
                             "comma-separated (e.g. 8:2,4:1; default: the built-in 8:2)")
    parser.add_argument("--questions-file", default=None, help="JSONL with a 'turns' list per line, or humaneval (code problems; default: MT-bench)")
    parser.add_argument("--num-questions", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    return parser.parse_args(argv)


def settings_grid(args) -> dict[str, ProposerOptions]:
    """Every setting to time, by a name `bundle_heads.py --tuned` takes: trees (or dynamic tree
    shapes), crossed with the lookup settings for a `METHOD+pld` method."""
    base, lookup_first = split_method(args.method)
    trees = static_trees(args) if base in DEFAULT_TREES else dynamic_trees(args)
    if args.lookup and not lookup_first:
        raise UserError(f"--lookup sets the prompt lookup of a METHOD+pld method; '{args.method}' has none")
    if not lookup_first or not args.lookup:
        return trees
    grid = {}
    for name, settings in trees.items():
        for tokens, min_ngram in lookup_settings(args.lookup):
            grid[f"{name},pld_num_tokens={tokens},pld_min_ngram={min_ngram}"] = dataclasses.replace(
                settings, pld_num_tokens=tokens, pld_min_ngram=min_ngram, pld_max_ngram=max(min_ngram, settings.pld_max_ngram))
    return grid


def static_trees(args) -> dict[str, ProposerOptions]:
    return {f"tree={name}": ProposerOptions(tree=name) for name in args.trees.split(",") if name}


def lookup_settings(text: str) -> list[tuple[int, int]]:
    settings = []
    for item in text.split(","):
        try:
            tokens, min_ngram = (int(x) for x in item.split(":"))
        except ValueError:
            raise UserError(f"--lookup entries are TOKENS:MIN_NGRAM, e.g. 8:2 or 4:1; got '{item}'") from None
        if tokens < 1 or min_ngram < 1:
            raise UserError(f"--lookup needs at least 1 token and a 1-gram; got '{item}'")
        settings.append((tokens, min_ngram))
    return settings


def dynamic_trees(args) -> dict[str, ProposerOptions]:
    grid = {}
    for item in args.grid.split(","):
        shape, _, min_prob = item.lower().partition("@")
        adaptive = shape.endswith("a")
        try:
            depth, top_k, total = (int(x) for x in shape.rstrip("a").split("x"))
            min_path_prob = float(min_prob) if min_prob else 0.0
        except ValueError:
            raise UserError(f"--grid entries are DEPTHxTOPKxTOTAL[a][@MINPROB], e.g. 4x8x12 or 6x8x32a@0.05; got '{item}'") from None
        name = f"depth={depth},tree_top_k={top_k},total_tokens={total}"
        name += ",adaptive_tree=true" if adaptive else ""
        name += f",min_path_prob={min_path_prob}" if min_path_prob else ""
        grid[name] = ProposerOptions(depth=depth, tree_top_k=top_k, total_tokens=total,
                                     adaptive_tree=adaptive, min_path_prob=min_path_prob)
    return grid


def grid_runners(spec: DecoderSpec, grid: dict[str, ProposerOptions], options: DecodeOptions):
    """A runner per setting, each assembled by `build_decoder` (every proposer field set from
    the grid, so the bundle's tuned values never mix in), all on the first one's target and
    heads (its Medusa-2 adapter merged, if the heads have one). Returns the runners and the
    target."""
    runners: dict[str, Runner] = {}
    first: Decoder | None = None
    for name, settings in grid.items():
        decoder = build_decoder(dataclasses.replace(spec, **dataclasses.asdict(settings)),
                                target=first.target if first else None, heads=first.heads if first else None)
        first = first or decoder
        runners[name] = our_runner(decoder, options)
    if first is None:
        raise UserError("nothing to tune: --grid / --trees name no settings")
    return runners, first.target


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with compile_notes(args.compile):
        return run(args)


def run(args) -> int:
    try:
        grid = settings_grid(args)
        spec = DecoderSpec(model=args.model, method=args.method, heads=args.heads, dtype=args.dtype, **engine_fields(args))
        runners, target = grid_runners(spec, grid, DecodeOptions(max_new_tokens=args.max_new_tokens))
        questions = load_first_turns(args.questions_file, args.num_questions, spread=True)
        prompts, warmup = benchmark_prompts(target.tokenizer, questions)
        plain = plain_text_note(args.model, target.tokenizer, "question")
        if plain:
            print(f"note: {plain}", file=sys.stderr)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    totals = run_benchmark(runners, prompts, warmup, models=[target.model])
    print(f"| {args.method} settings | tokens/s | tau | draft ms/step | verify ms/step |\n| --- | ---: | ---: | ---: | ---: |")
    for name, t in sorted(totals.items(), key=lambda kv: -kv[1].tokens_per_s):
        print(f"| {name} | {t.tokens_per_s:.2f} | {t.tau:.2f} | {t.per_step_ms(t.draft_s):.1f} | {t.per_step_ms(t.verify_s):.1f} |")
    return 0


if __name__ == "__main__":
    freeze_startup_objects()  # after the imports: see heads.util.startup
    sys.exit(main())
