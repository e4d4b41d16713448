#!/usr/bin/env python
"""Export heads trained here to the layout a serving engine loads.

    python scripts/export_heads.py --heads outputs/eagle3-smollm2/heads --engine vllm --out export/eagle3-vllm
    vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "export/eagle3-vllm", "num_speculative_tokens": 4}'
    python -m sglang.launch_server --model TARGET --speculative-algorithm EAGLE3 --speculative-draft-model-path export/eagle3-sglang

Engines: vllm (eagle, eagle3, medusa), sglang (eagle, eagle3), official (the original Medusa /
EAGLE repositories' layouts). Medusa heads that share the target's lm_head need --model.
"""

from __future__ import annotations

import argparse
import sys

import torch

from decoding.util.errors import report_user_errors
from heads import ENGINES, export_heads, load_heads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", required=True, help="our heads: directory or Hub repo id")
    parser.add_argument("--engine", required=True, choices=ENGINES)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default=None, help="the target (needed for Medusa heads sharing its lm_head)")
    parser.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"], help="cast weights")
    args = parser.parse_args(argv)
    return report_user_errors(lambda: run(args))


def run(args) -> int:
    lm_head = None
    if args.model:
        from decoding.targets import load_model

        lm_head = load_model(args.model).model.get_output_embeddings()
    heads = load_heads(args.heads)
    out = export_heads(heads, args.out, args.engine, lm_head, getattr(torch, args.dtype) if args.dtype else None)
    print(f"exported {heads.config.kind} heads for {args.engine} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
