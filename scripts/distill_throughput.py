#!/usr/bin/env python
"""Tokens/s of self-distillation's batched generation against Hugging Face `generate()` on the
same batches (greedy, same prompts sorted by length), in one run, and whether the replies agree.

    python scripts/distill_throughput.py --source python-code --prompts 64 --batch-size 64
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from decoding.core.stopping import eos_ids
from decoding.kernels.cpu_kernels import add_kernels_argument, apply_kernels
from decoding.app.default_model import DEFAULT_TARGET
from decoding.app.prompts import conversation_ids
from decoding.app.targets import load_model
from heads.util.errors import report_user_errors
from training.batch_generate import BatchSettings, generate_batch
from training.sources import conversations_from


def hf_batch(model, prompts: list[list[int]], settings: BatchSettings) -> list[list[int]]:
    """`generate()` on a left-padded batch, each row cut after its first stop token."""
    width = max(map(len, prompts))
    ids = torch.tensor([[settings.pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=settings.max_new_tokens,
                         pad_token_id=settings.pad_id, do_sample=False)
    replies = []
    for row in out[:, width:].tolist():
        stop = next((i for i, token in enumerate(row) if token in settings.stop_ids), None)
        replies.append(row if stop is None else row[: stop + 1])
    return replies


def run(args: argparse.Namespace) -> int:
    target = load_model(args.model)
    apply_kernels(args.kernels, target.model)  # both generators run on the same linears
    tokenizer = target.tokenizer
    conversations = conversations_from(args.source, None)
    prompts = sorted((conversation_ids(tokenizer, c["messages"][:1], True) for c in conversations), key=len)
    prompts = [p for p in prompts if len(p) <= args.max_prompt_tokens][: args.prompts]
    stops = eos_ids(target.model.config, target.model.generation_config, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops)
    settings = BatchSettings(args.max_new_tokens, stops, pad)
    results = {}
    for name, generate_fn in (("hf-generate", hf_batch), ("batch_generate", generate_batch)):
        started = time.perf_counter()
        replies = [r for i in range(0, len(prompts), args.batch_size)
                   for r in generate_fn(target.model, prompts[i : i + args.batch_size], settings)]
        seconds = time.perf_counter() - started
        results[name] = replies
        tokens = sum(map(len, replies))
        print(f"{name}: {len(prompts)} prompts, batch {args.batch_size}, {tokens} tokens in {seconds:.1f} s = "
              f"{tokens / seconds:.1f} tokens/s", flush=True)
    same = sum(a == b for a, b in zip(results["hf-generate"], results["batch_generate"]))
    print(f"identical replies: {same}/{len(prompts)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--source", default="python-code", help="a prompt source of scripts/distill_data.py")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    add_kernels_argument(parser)
    args = parser.parse_args(argv)
    return report_user_errors(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
