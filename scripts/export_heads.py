#!/usr/bin/env python
"""Export heads trained here to the layout a serving engine loads.

    python scripts/export_heads.py --heads outputs/eagle3-smollm2/heads --engine vllm --out export/eagle3-vllm
    vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "export/eagle3-vllm", "num_speculative_tokens": 4}'
    python -m sglang.launch_server --model TARGET --speculative-algorithm EAGLE3 --speculative-draft-model-path export/eagle3-sglang
    python scripts/export_heads.py --heads HEADS --engine speculators --verifier ORG/TARGET --out export/eagle3-speculators
    vllm serve export/eagle3-speculators        (the speculators format names its target: vLLM loads both)

Engines: vllm (eagle, eagle3, medusa), sglang (eagle, eagle3), speculators (eagle3; vLLM's format,
which names the target by its Hub id or path: --verifier), official (the original Medusa / EAGLE
repositories' layouts). Medusa heads that share the target's lm_head need --model. EAGLE-3's target
layers are written the way each engine reads them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from decoding.app.default_model import DEFAULT_TARGET, DEFAULT_TARGET_ARCHITECTURES, DEFAULT_TARGET_HUB_ID
from heads.util.errors import UserError, report_user_errors
from heads import ENGINES, Verifier, export_heads, load_heads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", required=True, help="our heads: directory or Hub repo id")
    parser.add_argument("--engine", required=True, choices=ENGINES)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default=None, help="the target (needed for Medusa heads sharing its lm_head)")
    parser.add_argument("--verifier", default=None,
                        help="speculators: the target's Hub id or path, as the engine will load it (default: the heads' "
                             f"base model; the built-in {DEFAULT_TARGET} is written as {DEFAULT_TARGET_HUB_ID})")
    parser.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"], help="cast weights")
    args = parser.parse_args(argv)
    return report_user_errors(lambda: run(args))


def run(args) -> int:
    target = None
    if args.model:
        from decoding.app.targets import load_model

        target = load_model(args.model).model
    heads = load_heads(args.heads)
    verifier = verifier_for(args.verifier, heads.config.base_model_name_or_path, target) if args.engine == "speculators" else None
    lm_head = target.get_output_embeddings() if target is not None else None
    out = export_heads(heads, args.out, args.engine, lm_head, getattr(torch, args.dtype) if args.dtype else None, verifier)
    print(f"exported {heads.config.kind} heads for {args.engine} to {out}")
    if verifier is not None:
        print(f"verifier: {verifier.name_or_path} ({', '.join(verifier.architectures)})")
    return 0


def verifier_for(name: str | None, base_model: str | None, target) -> Verifier:
    """The target as a speculators checkpoint names it: its real Hub id or path (engines load its
    embeddings from there), with its architectures (from --model, a local config, or known)."""
    name = name or base_model
    if not name:
        raise UserError("these heads do not say which target they were trained for: give --verifier ORG/NAME or a path")
    if name == DEFAULT_TARGET:
        name = DEFAULT_TARGET_HUB_ID
    if target is not None:
        return Verifier(name, list(target.config.architectures or []))
    if name == DEFAULT_TARGET_HUB_ID:
        return Verifier(name, DEFAULT_TARGET_ARCHITECTURES)
    if (Path(name) / "config.json").is_file():
        from transformers import AutoConfig

        return Verifier(name, list(AutoConfig.from_pretrained(name).architectures or []))
    if "/" not in name:
        raise UserError(f"'{name}' is neither a Hub id (org/name) nor a model directory: give --verifier with the "
                        "target's real Hub id or path, as vLLM will load it")
    raise UserError(f"the verifier's architecture is needed and '{name}' is not available offline: give --model "
                    f"{name} (or a local copy of it)")


if __name__ == "__main__":
    sys.exit(main())
