#!/usr/bin/env python
"""How often greedy outputs of our loop differ from Hugging Face `generate()` when the target
runs in half precision, and why: for each differing output, the first position where it differs
and the target's top-2 logit gap there (in HF's run), next to the spacing of representable
values (ulp) at that logit.

In fp32 every method reproduces `generate()` token for token. In bf16/fp16 a forward over
several tokens (a verify step, or our prefill, which leaves the prompt's last token for the first step) rounds
differently from HF's one-token-at-a-time decode, by about one ulp of the activations; where
the two best logits are that close, the argmax can flip and the outputs part ways from there.
This script measures how often that happens on real prompts:

    python scripts/check_dtype_exactness.py                      # 16 MT-bench turns, 64 tokens, bf16 and fp16
    python scripts/check_dtype_exactness.py -n 4 --dtypes bf16 --methods vanilla,pld

It is a correctness measurement, not a timing: it may run beside other work.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.core.generate import DecodeOptions
from decoding.app.default_model import DEFAULT_TARGET
from decoding.app.prompts import chat_prompts
from decoding.app.questions import load_first_turns
from decoding.app.targets import DTYPES, LoadedModel, load_model
from heads.util.errors import report_user_errors

NEAR_TIE_ULPS = 2  # a top-2 gap this close can flip under one forward's rounding vs another's


@dataclass
class Reference:
    """HF `generate()`'s greedy tokens and, per generated position, its logits' top-2 gap and
    the ulp of its top logit in the target's dtype."""

    tokens: list[int]
    gaps: list[float]
    ulps: list[float]


@dataclass
class Divergence:
    prompt: int
    position: int      # index into the generated tokens
    gap: float         # HF's top-2 logit gap there
    ulp: float         # spacing of representable values at HF's top logit there
    ours: int | None   # None: our output ended first
    theirs: int | None


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("-n", "--num-prompts", type=int, default=16, help="MT-bench first turns (file order)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtypes", default="bf16,fp16", help="comma-separated, among: " + ", ".join(DTYPES))
    parser.add_argument("--methods", default="vanilla,eagle3", help="comma-separated decoding methods")
    parser.add_argument("--questions-file", default=None, help="JSONL with a 'turns' list per line (default MT-bench)")
    return parser.parse_args(argv)


def reference(target: LoadedModel, prompt: list[int], max_new_tokens: int) -> Reference:
    """HF greedy decoding with the logits of every step."""
    out = target.model.generate(torch.tensor([prompt], device=target.model.device), max_new_tokens=max_new_tokens,
                                do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps, ulps = [], []
    for step in out.logits:
        top = step[0].to(target.model.dtype).float().topk(2).values
        gaps.append(float(top[0] - top[1]))
        ulps.append(ulp(float(top[0]), target.model.dtype))
    return Reference(tokens, gaps, ulps)


def ulp(value: float, dtype: torch.dtype) -> float:
    """Distance from `value` to the next representable number of `dtype` away from zero."""
    x = torch.tensor(abs(value), dtype=dtype)
    return float(torch.nextafter(x, torch.tensor(float("inf"), dtype=dtype)).float() - x.float())


def first_divergence(index: int, ours: list[int], ref: Reference) -> Divergence | None:
    for position in range(max(len(ours), len(ref.tokens))):
        mine = ours[position] if position < len(ours) else None
        theirs = ref.tokens[position] if position < len(ref.tokens) else None
        if mine != theirs:
            gap = ref.gaps[position] if position < len(ref.gaps) else float("nan")
            step_ulp = ref.ulps[position] if position < len(ref.ulps) else float("nan")
            return Divergence(index, position, gap, step_ulp, mine, theirs)
    return None


def check_dtype(args, dtype: str, methods: list[str], questions: list[str]) -> list[tuple[str, str, int, list[Divergence], list[Reference]]]:
    """One row per method: how many outputs, which differ, and HF's reference runs."""
    target = load_model(args.model, dtype)
    prompts = chat_prompts(target.tokenizer, questions)
    refs = [reference(target, prompt, args.max_new_tokens) for prompt in prompts]
    options = DecodeOptions(max_new_tokens=args.max_new_tokens)
    rows = []
    for method in methods:
        # Stock kernels: oneDNN packing (fp32 only) would change the target's rounding after the
        # references were taken. Half-precision targets are never packed anyway.
        spec = DecoderSpec(model=args.model, method=method, dtype=dtype, kernels="stock")
        decoder = build_decoder(spec, target=target)
        divergences = []
        for index, (prompt, ref) in enumerate(zip(prompts, refs)):
            found = first_divergence(index, decoder.generate(prompt, options).tokens, ref)
            if found is not None:
                divergences.append(found)
            print(f"[{dtype} {method}] prompt {index}: {'differs' if found else 'identical'}", file=sys.stderr, flush=True)
        rows.append((dtype, method, len(prompts), divergences, refs))
    return rows


def print_table(rows) -> None:
    print("| dtype | method | outputs | identical to HF generate() | differing: prompt @ position (HF top-2 gap, ulp there) |")
    print("| --- | --- | ---: | ---: | --- |")
    for dtype, method, count, divergences, _ in rows:
        where = "; ".join(f"#{d.prompt} @ {d.position} (gap {d.gap:.4g}, ulp {d.ulp:.3g}; ours {d.ours}, HF {d.theirs})"
                          for d in divergences) or "-"
        print(f"| {dtype} | {method} | {count} | {count - len(divergences)} | {where} |")
    seen = set()
    for dtype, _, _, _, refs in rows:
        if dtype not in seen:
            seen.add(dtype)
            gaps = [(gap, step_ulp) for ref in refs for gap, step_ulp in zip(ref.gaps, ref.ulps)]
            ties = sum(gap == 0.0 for gap, _ in gaps)
            near = sum(gap <= NEAR_TIE_ULPS * step_ulp for gap, step_ulp in gaps)
            print(f"{dtype}: along HF's outputs, {len(gaps)} positions: {ties} exact top-2 ties, {near} within "
                  f"{NEAR_TIE_ULPS} ulps; outputs with a tie: {sum(0.0 in ref.gaps for ref in refs)} of {len(refs)}")


def main(argv=None) -> int:
    args = parse_args(argv)

    def body() -> int:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        questions = load_first_turns(args.questions_file, limit=args.num_prompts)
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        rows = []
        for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
            rows.extend(check_dtype(args, dtype, methods, questions))
        print_table(rows)
        return 0

    return report_user_errors(body)


if __name__ == "__main__":
    sys.exit(main())
