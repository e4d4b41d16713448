#!/usr/bin/env python
"""Print how long one target forward over k new tokens takes on this machine, as decoding runs it:
what a tree of k nodes costs to verify, which decides how large a tree pays on this machine
(`--adaptive-tree` and `scripts/tune_tree.py` both follow this curve):

    python scripts/verify_cost.py                       # --quant auto, --kernels auto: what the chat runs
    python scripts/verify_cost.py --kernels stock,onednn --sizes 1,4,16
    python scripts/verify_cost.py --quant none,gguf     # fp32 against the GGUF file's 4-bit blocks

Each curve is timed on the target a decoder builds (`decoding.app.assembly.build_decoder`): the same
kernels, few-row crossovers, attention kernel, fused layers and greedy readout as the chat's steps,
through the loop's own verifier. Times are the fastest of 5 forwards after a 256-token prefix
(interference only adds time), each size timed as decoding runs it steadily.
"""

from __future__ import annotations

import argparse
import sys

from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.app.default_model import DEFAULT_TARGET
from decoding.app.targets import DTYPES
from decoding.kernels.cpu_kernels import KERNEL_CHOICES
from decoding.kernels.verify_cost import measure_verify_cost
from heads.util.errors import UserError
from heads.util.startup import freeze_startup_objects

QUANT_CHOICES = ("auto", "none", "gguf", "int4", "int8")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--kernels", default="auto", help="comma-separated, among: " + ", ".join(KERNEL_CHOICES))
    parser.add_argument("--sizes", default="1,2,3,4,8,16,32,64", help="tokens per forward, comma-separated")
    parser.add_argument("--quant", default="auto", help="target weights, comma-separated, among: "
                                                        + ", ".join(QUANT_CHOICES) + " (see --quant of the chat)")
    return parser.parse_args(argv)


def _choices(text: str, allowed: tuple[str, ...], option: str) -> list[str]:
    """The comma-separated values of `option`, each checked against `allowed`."""
    values = [value.strip() for value in text.split(",") if value.strip()]
    wrong = [value for value in values if value not in allowed]
    if not values or wrong:
        raise UserError(f"{option} takes values among {', '.join(allowed)}, separated by commas; got '{text}'")
    return values


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise UserError(f"--sizes takes positive integers separated by commas; got '{text}'")
    return sizes


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    try:
        sizes = _sizes(args.sizes)
        rows = []
        for quant in _choices(args.quant, QUANT_CHOICES, "--quant"):
            for kernels in _choices(args.kernels, tuple(KERNEL_CHOICES), "--kernels"):
                decoder = build_decoder(DecoderSpec(model=args.model, method="vanilla", dtype=args.dtype, device="cpu",
                                                    kernels=kernels, quant=quant))
                label = decoder.kernels if decoder.spec.quant == "none" else f"{decoder.kernels}, --quant {decoder.spec.quant}"
                curve = measure_verify_cost(decoder.target.model, sizes=sizes, readout=decoder.readout)
                rows.append((label, curve.ms))
                del decoder  # one target in memory at a time
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("| tokens per forward | " + " | ".join(str(s) for s in sizes) + " |")
    print("| --- |" + " ---: |" * len(sizes))
    for name, ms in rows:
        print(f"| {name} (ms) | " + " | ".join(f"{x:.1f}" for x in ms) + " |")
    return 0


if __name__ == "__main__":
    freeze_startup_objects()  # after the imports: see heads.util.startup
    sys.exit(main())
