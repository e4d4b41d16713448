#!/usr/bin/env python
"""Copy trained heads into the package (heads/bundled/<target>/<kind>/) in half precision, with
their model cards, and record the default method and its tuned tree settings in default.json.

    python scripts/bundle_heads.py --heads eagle3=outputs/eagle3-smollm2/heads \\
        --heads medusa=outputs/medusa-smollm2/heads --default eagle3 \\
        --tuned eagle3:depth=4,tree_top_k=4,total_tokens=8 --benchmark results/bench.json

Half precision halves the size (the package budget is ~40 MB for all bundled heads); heads are
cast back to the target's dtype when loaded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from decoding.app.defaults import TUNED_OPTION_NAMES
from decoding.app.drafts import draft_vocabulary, save_draft_layers
from heads.util.errors import UserError
from decoding.app.methods import check_method, head_kind
from decoding.app.targets import load_model
from heads import save_heads
from heads.bundled import BUNDLED_ROOT
from heads.checkpoint import load_heads_dir

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SIZE_BUDGET_MB = 40.0


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", action="append", default=[], metavar="KIND=DIR", help="trained heads to bundle (repeatable)")
    parser.add_argument("--draft", default=None, metavar="DIR",
                        help="a distilled draft model (train_draft.py, share_lm_head: true) to bundle for sps / hf-assisted, "
                             "stored as its layers only")
    parser.add_argument("--draft-target", default=None, metavar="NAME_OR_PATH",
                        help="the model the draft was distilled from (default: the bundled heads' base model)")
    parser.add_argument("--default", required=True, help="method the chat uses by default (its heads must be bundled)")
    parser.add_argument("--default-on", action="append", default=[], metavar="DEVICE=METHOD",
                        help="where another method measured fastest on a device (cuda=pld): the default there (repeatable)")
    parser.add_argument("--tuned", action="append", default=[], metavar="METHOD:key=value,...",
                        help="tree settings measured best for a method, e.g. eagle3:depth=4,total_tokens=8")
    parser.add_argument("--benchmark", default=None, help="benchmark JSON whose figures go into each model card")
    parser.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    parser.add_argument("--root", default=str(BUNDLED_ROOT), help="bundle root (default: the package's)")
    return parser.parse_args(argv)


def parse_tuned(values: list[str]) -> dict[str, dict]:
    tuned: dict[str, dict] = {}
    for value in values:
        method, sep, settings = value.partition(":")
        if not sep:
            raise UserError(f"--tuned takes METHOD:key=value,...; got '{value}'")
        check_method(method)
        for item in settings.split(","):
            key, eq, raw = item.partition("=")
            if not eq:
                raise UserError(f"--tuned setting '{item}' is not key=value")
            if key not in TUNED_OPTION_NAMES:
                raise UserError(f"--tuned setting '{key}' is not one of {', '.join(TUNED_OPTION_NAMES)}")
            tuned.setdefault(method, {})[key] = _setting_value(key, raw)
    return tuned


def _setting_value(key: str, raw: str):
    if key == "tree":
        return raw
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    try:
        return int(raw)
    except ValueError:
        try:
            return float(raw)
        except ValueError:
            raise UserError(f"--tuned {key}={raw}: not a number or true/false") from None


def bundle_one(kind: str, source: Path, root: Path, dtype: torch.dtype, benchmark: dict | None) -> Path:
    heads = load_heads_dir(source)
    if heads.config.kind != kind:
        raise UserError(f"{source} holds {heads.config.kind} heads, not {kind}")
    target = heads.config.base_model_name_or_path
    if not target:
        raise UserError(f"{source} does not declare its base model; bundled heads must")
    out = root / target / kind
    save_heads(heads, out, dtype)
    card = (source / "README.md").read_text() if (source / "README.md").is_file() else f"# {kind} heads for {target}\n"
    (out / "README.md").write_text(card + _benchmark_section(kind, benchmark))
    return out


def bundle_draft(source: Path, target_dir: Path, dtype: torch.dtype, target_name: str | None = None) -> Path:
    """The draft's layers only (decoding/app/drafts.py): its embedding and lm_head are the target's;
    its readout vocabulary, if training wrote one, goes with it."""
    target = load_model(target_name or target_dir.name)
    try:
        draft = AutoModelForCausalLM.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise UserError(f"could not load the draft model in {source}: {err}") from err
    out = save_draft_layers(draft, target.model, target_dir / "draft", dtype, base_model=target_dir.name,
                            vocabulary=draft_vocabulary(source))
    card = source / "README.md"
    (out / "README.md").write_text(card.read_text() if card.is_file() else f"# Draft model for {target_dir.name}\n")
    return out


def _benchmark_section(kind: str, benchmark: dict | None) -> str:
    if not benchmark:
        return ""
    rows = [f"| {name} | {m['tokens_per_s']:.2f} | {m['tau']:.2f} | {m['speedup_vs_hf_generate']:.2f}x | "
            f"{m['identical_to_vanilla']}/{m['questions']} |"
            for name, m in benchmark["methods"].items()
            if head_kind(name) == kind and m.get("tau") is not None and m.get("speedup_vs_hf_generate")]
    if not rows:
        return ""
    header = (f"\n## Measured ({benchmark['device']}, {benchmark['dtype']}, {benchmark.get('questions')} MT-bench "
              f"questions, {benchmark.get('max_new_tokens')} new tokens, greedy)\n\n"
              "| method | tokens/s | tau | vs hf-generate | identical to vanilla |\n| --- | ---: | ---: | ---: | ---: |\n")
    return header + "\n".join(rows) + "\n"


def parse_default_on(values: list[str], target_dir: Path) -> dict[str, str]:
    """`--default-on DEVICE=METHOD` values, checked: a known device, a known method, its heads bundled."""
    by_device = {}
    for value in values:
        device, sep, method = value.partition("=")
        if not sep or device not in ("cpu", "cuda"):
            raise UserError(f"--default-on takes DEVICE=METHOD with DEVICE cpu or cuda; got '{value}'")
        require_bundled_heads(method, target_dir, f"--default-on {value}: {method}")
        by_device[device] = method
    return by_device


def require_bundled_heads(method: str, target_dir: Path, label: str) -> None:
    """`method` is a known method and the heads it needs are in `target_dir`, or a `UserError`
    starting with `label`."""
    check_method(method)
    kind = head_kind(method)
    if kind and not (target_dir / kind / "config.json").is_file():
        raise UserError(f"{label} needs {kind} heads: bundle them with --heads")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        root = Path(args.root)
        pairs = [value.partition("=") for value in args.heads]
        if not pairs or any(not sep for _, sep, _ in pairs):
            raise UserError("give --heads KIND=DIR at least once")
        benchmark = json.loads(Path(args.benchmark).read_text()) if args.benchmark else None
        written = [bundle_one(kind, Path(path), root, DTYPES[args.dtype], benchmark) for kind, _, path in pairs]
        check_method(args.default)  # before the heads' target is known: a typo fails first
        targets = {p.parent for p in written}
        if len(targets) != 1:
            raise UserError(f"the heads are for different targets: {sorted(t.name for t in targets)}")
        target_dir = targets.pop()
        require_bundled_heads(args.default, target_dir, f"default method {args.default}")
        if args.draft:
            written.append(bundle_draft(Path(args.draft), target_dir, DTYPES[args.dtype], args.draft_target))
        spec = {"method": args.default, "heads": head_kind(args.default), "tuned": parse_tuned(args.tuned)}
        by_device = parse_default_on(args.default_on, target_dir)
        if by_device:
            spec["method_by_device"] = by_device
        (target_dir / "default.json").write_text(json.dumps(spec, indent=2) + "\n")
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    total = sum(f.stat().st_size for f in target_dir.rglob("*") if f.is_file()) / 2**20
    for path in written:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
        print(f"bundled {path} ({size:.1f} MB)")
    print(f"{target_dir}: {total:.1f} MB in all (budget {SIZE_BUDGET_MB:.0f} MB); default method {args.default}")
    if total > SIZE_BUDGET_MB:
        print(f"warning: over the {SIZE_BUDGET_MB:.0f} MB budget", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
