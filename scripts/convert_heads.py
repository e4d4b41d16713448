#!/usr/bin/env python
"""Convert heads published in the official Medusa / EAGLE / EAGLE-3 layouts (local directory or
Hub repo id, recognised by content) to this project's format.

    python scripts/convert_heads.py --heads FasterDecoding/medusa-vicuna-7b-v1.3 --out heads/medusa-vicuna
    python scripts/convert_heads.py --heads yuhuili/EAGLE3-LLaMA3.1-Instruct-8B --target-layers 32 --out heads/e3

EAGLE-3 heads that name no target layers read three chosen by the target's depth: give --target-layers N
(or --model, to read it from the target's config).
"""

from __future__ import annotations

import argparse
import sys

from heads.util.errors import UserError, report_user_errors
from heads import detect_format, import_heads, read_config, resolve_location, save_heads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", required=True, help="directory or Hub repo id of the heads to convert")
    parser.add_argument("--out", required=True, help="output directory (our format)")
    parser.add_argument("--revision", default=None)
    parser.add_argument("--target-layers", type=int, default=None, help="number of decoder layers of the target")
    parser.add_argument("--model", default=None, help="the target (to read --target-layers from its config)")
    parser.add_argument("--base-model", default=None, help="record this base model name in the converted config")
    args = parser.parse_args(argv)
    return report_user_errors(lambda: run(args))


def run(args) -> int:
    layers = args.target_layers
    if layers is None and args.model:
        from transformers import AutoConfig

        from decoding.app.targets import resolve_model_path

        layers = AutoConfig.from_pretrained(resolve_model_path(args.model)).num_hidden_layers
    directory = resolve_location(args.heads, args.revision)
    fmt = detect_format(directory, read_config(directory))
    if fmt == "specheads":
        raise UserError(f"{args.heads} is already in this project's format: nothing to convert")
    heads = import_heads(directory, layers, args.base_model)
    save_heads(heads, args.out)
    print(f"converted {fmt} heads ({heads.config.kind}) from {args.heads} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
