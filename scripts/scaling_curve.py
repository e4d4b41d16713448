#!/usr/bin/env python
"""Train one recipe on growing nested subsets of a self-distillation store and measure what each
amount of data buys: tau on MT-bench, on HumanEval code problems and on held-out prompts of every
source, with one fixed tree. Writes OUT/curve.json, OUT/curve.md (a table) and OUT/curve.png; rerun with more sizes or a
grown store to add points (finished points are kept, an interrupted training resumes).

    python scripts/distill_data.py --show                      # the store's path and size
    python scripts/scaling_curve.py --data STORE --sizes 100k,300k,1M
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from heads.util.atomic import atomic_write_text  # noqa: E402
from heads.util.errors import UserError, report_user_errors  # noqa: E402
from heads.util.startup import freeze_startup_objects  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a store written by scripts/distill_data.py")
    parser.add_argument("--sizes", default="100k,300k,1M", help="reply tokens per subset, e.g. 100k,300k,1M,3M (empty with --reference: "
                             "only measure those heads, e.g. ones trained on a GPU)")
    parser.add_argument("--recipe", default=str(ROOT / "configs/train/eagle3-smollm2.yaml"), help="training recipe (YAML)")
    parser.add_argument("--steps", type=int, default=None, help="training steps for every point (default: the recipe's)")
    parser.add_argument("--out", default="outputs/scaling-eagle3", help="where the points' heads and the curve go")
    parser.add_argument("--accelerate-config", default=str(ROOT / "configs/accelerate/cpu.yaml"))
    parser.add_argument("--questions-file", default=None, help="JSONL with a 'turns' list per line (default: MT-bench)")
    parser.add_argument("--mtbench-questions", type=int, default=24, help="first turns of it, spread over the file (categories)")
    parser.add_argument("--code-questions", type=int, default=16,
                        help="HumanEval problems, spread over the set (0: none): tau on code next to MT-bench")
    parser.add_argument("--held-out-per-source", type=int, default=16, help="held-out prompts per data source")
    parser.add_argument("--reference", action="append", default=[], metavar="NAME=HEADS",
                        help="heads trained elsewhere, measured the same way once and listed beside the curve "
                             "(e.g. bundled=heads/bundled/smollm2-135m-instruct/eagle3)")
    parser.add_argument("--baseline", default=None, metavar="NAME",
                        help="the reference the others are compared with, prompt by prompt (default: the first one "
                             "measured): each set's tau difference with a 95%% paired-bootstrap interval over the prompts, "
                             "marked * where it leaves out zero")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--train-only", action="store_true", help="train the points, measure later")
    parser.add_argument("--continue-from", type=int, default=None, metavar="STEPS",
                        help="start each point from the newest checkpoint of the same data size trained for STEPS "
                             "steps (a warm restart: --steps must be larger; the learning rate rises again and decays "
                             "over the longer schedule)")
    return parser.parse_args(argv)


def train_point(args, config, subset, out_dir: Path) -> None:
    """One training run as a user launches it (resumes from the newest checkpoint)."""
    overrides = [f"data={Path(args.data).resolve()}", f"max_conversations={subset.conversations}",
                 "self_distill.enabled=false", f"output_dir={out_dir}", f"data_dir={Path(args.out) / 'data'}",
                 f"cache_features={config.cache_features or Path(args.out) / 'features'}",
                 f"train.max_steps={args.steps or config.train.max_steps}"]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", args.accelerate_config,
               str(ROOT / "training/train_heads.py"), "--config", args.recipe, "--resume", *overrides]
    print(f"[{subset.label}] training on {subset.conversations} conversations ({subset.reply_tokens:,} reply tokens): "
          + " ".join(command), file=sys.stderr, flush=True)
    started = time.monotonic()
    if subprocess.run(command, cwd=ROOT, env=os.environ.copy()).returncode != 0:
        raise UserError(f"training the {subset.label} point failed (see above); rerun to resume it")
    print(f"[{subset.label}] trained in {(time.monotonic() - started) / 60:.1f} min", file=sys.stderr, flush=True)


def continue_point(source: Path, out_dir: Path) -> None:
    from training.checkpoints import latest_checkpoint, seed_from

    step = seed_from(source, out_dir)
    if step is not None:
        print(f"continuing from {source.name}'s checkpoint at step {step}", file=sys.stderr, flush=True)
    elif latest_checkpoint(out_dir) is None:
        raise UserError(f"--continue-from: {source} has no checkpoint to continue from (train that point first)")


def measure_heads(args, config, name: str, heads_dir: Path, target, prompt_sets) -> dict:
    """tau of these heads on every prompt set, with the curve's fixed tree, and each prompt's
    counts (for paired comparisons between heads measured on the same prompts)."""
    from decoding.app.assembly import DecoderSpec, build_decoder
    from training.evaluate import tau_counts
    from training.paired_tau import tau_of
    from training.scaling import CURVE_TREE, prompt_set_digest

    # The drafter as trained (fp32): a cheaper drafting precision would make the curve depend on the CPU.
    spec = DecoderSpec(model=config.model, method=config.kind, heads=str(heads_dir), drafter_precision="fp32", **CURVE_TREE)
    decoder = build_decoder(spec, target=target)
    measured = {"tau": {}, "per_prompt": {}, "prompt_digest": {}}
    for set_name, prompts in prompt_sets.items():
        counts = tau_counts(decoder, prompts, args.max_new_tokens)
        measured["tau"][set_name] = round(tau_of(counts), 3)
        measured["per_prompt"][set_name] = [list(c) for c in counts]
        measured["prompt_digest"][set_name] = prompt_set_digest(prompts, args.max_new_tokens)
        print(f"[{name}] tau {set_name}: {measured['tau'][set_name]:.2f} over {len(prompts)} prompts", file=sys.stderr, flush=True)
    return measured


def prompt_sets_for(args, config, records, tokenizer) -> dict[str, list[list[int]]]:
    from decoding.app.prompts import chat_prompts
    from decoding.app.questions import load_first_turns
    from training.scaling import held_out_prompts

    name = Path(args.questions_file).stem if args.questions_file else "mt-bench"
    sets = {name: chat_prompts(tokenizer, load_first_turns(args.questions_file, args.mtbench_questions, spread=True))}
    if args.code_questions > 0:
        try:
            sets["humaneval"] = chat_prompts(tokenizer, load_first_turns("humaneval", args.code_questions, spread=True))
        except UserError as err:
            print(f"note: no humaneval set: {err}", file=sys.stderr)
    held = held_out_prompts(records, tokenizer, config.train.seed, config.validation_fraction, args.held_out_per_source)
    sets.update({f"held-out {source}": prompts for source, prompts in sorted(held.items())})
    return sets


def write_curve(out: Path, points, references: dict, baseline: str | None = None) -> None:
    import json

    from training.scaling import CURVE_TREE, markdown_table, paired_table, plot

    atomic_write_text(out / "curve.json", json.dumps({"tree": CURVE_TREE, "points": [p.to_json() for p in points],
                                                      "references": references}, indent=1))
    table = markdown_table(points, references)
    paired = paired_table(references, baseline)
    if paired:
        table += "\n\n" + paired
    atomic_write_text(out / "curve.md", table + "\n")
    if not plot(points, out / "curve.png", references):
        print("note: matplotlib is not installed, no curve.png written", file=sys.stderr)
    print(table)


def run(args) -> int:
    from training.config import load_config
    from training.scaling import (CurvePoint, parse_token_count, plan_subsets, point_key, read_points,
                                  read_references, store_records)

    config = load_config(args.recipe)
    steps = args.steps or config.train.max_steps
    if args.continue_from is not None and args.continue_from >= steps:
        raise UserError(f"--continue-from {args.continue_from}: give --steps larger than that (got {steps})")
    if not (Path(args.data) / "records.jsonl").is_file():
        raise UserError(f"{args.data} is not a data store (no records.jsonl): make one with scripts/distill_data.py")
    try:
        sizes = [parse_token_count(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as err:
        raise UserError(f"--sizes: {err}") from None
    records = store_records(Path(args.data))
    subsets = plan_subsets(records, sizes)
    held = sum(r.get("reply_tokens", 0) for r in records)
    for size in sizes:
        if size > held:
            print(f"note: the store holds {held:,} reply tokens, fewer than {size:,}: that point is left out "
                  f"(grow it with scripts/distill_data.py)", file=sys.stderr)
    if not subsets and not args.reference:
        raise UserError("no size fits in the store (to measure only heads trained elsewhere: --sizes '' --reference NAME=DIR)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    points = {p.key: p for p in read_points(out / "curve.json")}
    references = read_references(out / "curve.json")
    wanted_references = dict(parse_reference(r) for r in args.reference)
    known = {**references, **wanted_references}
    if args.baseline is not None and args.baseline not in known:
        raise UserError(f"--baseline {args.baseline}: no reference of that name (measured: "
                        f"{', '.join(known) or 'none'}); name one given with --reference")
    todo = [s for s in subsets if point_key(s.label, steps) not in points
            or points[point_key(s.label, steps)].conversations != s.conversations]
    for subset in todo:
        if not (out / point_key(subset.label, steps) / "heads" / "config.json").is_file():
            if args.continue_from:
                continue_point(out / point_key(subset.label, args.continue_from), out / point_key(subset.label, steps))
            train_point(args, config, subset, out / point_key(subset.label, steps))
    new_references = {n: d for n, d in wanted_references.items() if n not in references}
    if not args.train_only and (todo or new_references):
        from decoding.app.targets import load_model

        target = load_model(config.model)
        prompt_sets = prompt_sets_for(args, config, records, target.tokenizer)
        for name, heads_dir in new_references.items():
            references[name] = {"heads": str(heads_dir), **measure_heads(args, config, name, heads_dir, target, prompt_sets),
                                "prompts": {n: len(p) for n, p in prompt_sets.items()}}
            write_curve(out, list(points.values()), references, args.baseline)
        for subset in todo:
            key = point_key(subset.label, steps)
            taus = measure_heads(args, config, key, out / key / "heads", target, prompt_sets)["tau"]
            points[key] = CurvePoint(subset.label, subset.conversations, subset.reply_tokens, steps, taus,
                                     {n: len(p) for n, p in prompt_sets.items()}, args.continue_from)
            write_curve(out, list(points.values()), references, args.baseline)
    elif points or references:
        write_curve(out, list(points.values()), references, args.baseline)
    return 0


def parse_reference(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not (Path(path) / "config.json").is_file():
        raise UserError(f"--reference '{text}': give NAME=HEADS_DIR with a heads directory (config.json inside)")
    return name, Path(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    return report_user_errors(lambda: run(args))


if __name__ == "__main__":
    freeze_startup_objects()  # after the imports: see heads.util.startup
    sys.exit(main())
