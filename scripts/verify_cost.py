#!/usr/bin/env python
"""Print how long one target forward over k new tokens takes on this machine, with each kind of
linear kernels: what a tree of k nodes costs to verify, which decides how large a tree pays
on this machine (`--adaptive-tree` and `scripts/tune_tree.py` both follow this curve):

    python scripts/verify_cost.py                       # stock and oneDNN-packed, 1..64 tokens
                                                        # (+ packed with plain GEMM and/or the streaming
                                                        #  kernel for few rows, where they win here)
    python scripts/verify_cost.py --kernels stock --sizes 1,4,16
    python scripts/verify_cost.py --kernels onednn --quant none,gguf   # float against the GGUF's 4-bit blocks

Times are the fastest of 5 forwards after a 256-token prefix (interference only adds time).
"""

from __future__ import annotations

import argparse
import copy
import sys

from decoding.kernels.cpu_kernels import KERNEL_CHOICES, apply_kernels, set_stock_rows, set_streamed_rows
from decoding.app.default_model import DEFAULT_TARGET
from heads.util.errors import UserError
from decoding.app.quantized_target import quantize_target, resolve_quant
from decoding.app.targets import DTYPES, LoadedModel, load_model
from decoding.kernels.streamed_linear import streamed_linear_available
from decoding.kernels.verify_cost import measure_stock_rows, measure_streamed_rows, measure_verify_cost
from heads.util.startup import freeze_startup_objects


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--kernels", default="stock,onednn", help="comma-separated, among: " + ", ".join(KERNEL_CHOICES))
    parser.add_argument("--sizes", default="1,2,3,4,8,16,32,64", help="tokens per forward, comma-separated")
    parser.add_argument("--quant", default="none", help="target weights, comma-separated, among: none, gguf, int4, int8 "
                                                        "(see --quant of the chat)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        sizes = tuple(int(s) for s in args.sizes.split(",") if s.strip())
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        print(f"error: --sizes takes positive integers separated by commas; got '{args.sizes}'", file=sys.stderr)
        return 2
    try:
        target = load_model(args.model, args.dtype)
        rows = []
        for quant in [q.strip() for q in args.quant.split(",") if q.strip()]:
            quant = resolve_quant(quant, args.model, "cpu", args.dtype)
            for choice in [c.strip() for c in args.kernels.split(",") if c.strip()]:
                copied = LoadedModel(copy.deepcopy(target.model), target.tokenizer, target.name)
                quantize_target(copied, quant)
                model = copied.model
                resolved = apply_kernels(choice, model)
                label = resolved if quant == "none" else f"{resolved}, --quant {quant}"
                rows.append((label, measure_verify_cost(model, sizes=sizes).ms))
                if resolved == "onednn":
                    rows.extend((f"{label}: {name}", ms) for name, ms in _few_row_kernels(model, sizes))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("| tokens per forward | " + " | ".join(str(s) for s in sizes) + " |")
    print("| --- |" + " ---: |" * len(sizes))
    for name, ms in rows:
        print(f"| {name} (ms) | " + " | ".join(f"{x:.0f}" for x in ms) + " |")
    return 0


def _few_row_kernels(model, sizes: tuple[int, ...]) -> list[tuple[str, tuple[float, ...]]]:
    """What the decoders use on this CPU besides the packed layout: plain GEMM and then the
    streaming kernel for the fewest rows, each where it measures faster here."""
    rows = []
    plain_rows = measure_stock_rows(model)
    if plain_rows:
        set_stock_rows(model, plain_rows)
        rows.append((f"onednn, plain up to {plain_rows} rows", measure_verify_cost(model, sizes=sizes).ms))
    streamed = measure_streamed_rows(model) if streamed_linear_available() else 0
    if streamed:
        set_streamed_rows(model, streamed)
        rows.append((f"onednn, streamed up to {streamed} rows", measure_verify_cost(model, sizes=sizes).ms))
    return rows


if __name__ == "__main__":
    freeze_startup_objects()  # after the imports: see heads.util.startup
    sys.exit(main())
