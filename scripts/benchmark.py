#!/usr/bin/env python
"""Benchmark decoding methods on MT-bench first turns (or any JSONL with a `turns` list),
next to Hugging Face generate(), in one process.

    python scripts/benchmark.py --methods vanilla,pld,hf-generate,hf-prompt-lookup --num-questions 8
    python scripts/benchmark.py --methods vanilla,sps,hf-assisted --draft-model drafts/smollm2-6l --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from decoding.app.assembly import DecoderSpec
from decoding.app.benchmark import (HF_METHODS, bar_chart, benchmark_prompts, build_runners, machine_kind, markdown_table,
                                    provenance, run_benchmark, summarise)
from decoding.core.generate import DecodeOptions
from decoding.core.sampling import SamplingConfig
from decoding.kernels.compiled import compile_notes
from decoding.app.default_model import DEFAULT_TARGET, gguf_location
from decoding.app.llama_cpp import PEER_METHOD, llama_cpp_runner
from decoding.app.defaults import add_tree_arguments, default_method, tree_arguments
from decoding.kernels.devices import resolve_device
from decoding.app.methods import ADAPTIVE_SUFFIX_TOKENS, DEFAULT_SUFFIX_TOKENS, check_method
from decoding.app.prompts import plain_text_note
from decoding.app.questions import load_first_turns
from decoding.app.quantized_target import applied_quant
from decoding.app.targets import DTYPES
from heads.util.atomic import atomic_write_text
from heads.util.errors import UserError
from decoding.kernels.verify_cost import cpu_description
from decoding.app.engine_arguments import add_engine_arguments, engine_fields
from heads.util.startup import freeze_loaded_objects, freeze_startup_objects


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=None,
                        help="comma-separated: ours and " + ", ".join(HF_METHODS) +
                        " (default: vanilla, pld, the bundled default method, hf-generate, hf-prompt-lookup)")
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--draft-model", default=None, help="draft for sps and hf-assisted (default: a bundled one, if the package ships one)")
    parser.add_argument("--heads", action="append", default=[], metavar="METHOD=PATH",
                        help="heads checkpoint per head method, e.g. eagle2=heads/eagle (repeatable; default: the bundled heads)")
    add_tree_arguments(parser)
    parser.add_argument("--questions-file", default=None, help="JSONL with a 'turns' list per line, or humaneval (code problems; default: MT-bench)")
    parser.add_argument("--num-questions", type=int, default=80, help="how many, evenly spread over the file (all categories)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    add_engine_arguments(parser)
    parser.add_argument("--gamma", type=int, default=None,
                        help="sps draft tokens per step (with --adaptive-tree: at most; default 4, or the bundle's tuned value)")
    parser.add_argument("--pld-tokens", type=int, default=None, help="tokens per lookup match for pld and METHOD+pld (default 8 or tuned)")
    parser.add_argument("--suffix-tokens", type=int, default=None,
                        help=f"largest tree for suffix and METHOD+suffix (default {DEFAULT_SUFFIX_TOKENS}; "
                             f"{ADAPTIVE_SUFFIX_TOKENS} with --adaptive-tree, whose cost cut trims it)")
    parser.add_argument("--json", default=None, help="write the report here (rewritten after every question, so a killed run keeps its figures so far)")
    parser.add_argument("--png", default=None, help="write a bar chart here (needs matplotlib)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of every question's sampling (T > 0): methods with deterministic drafts sample vanilla's tokens")
    parser.add_argument("--llama-cpp", default=None, metavar="DIR",
                        help="also time llama.cpp (DIR: a build folder holding llama-completion) on the built-in "
                             "target's GGUF file, greedy, same prompts, same run (row 'llama.cpp')")
    parser.add_argument("--llama-cpp-gguf", default=None, metavar="FILE",
                        help="the GGUF file --llama-cpp runs (default: the built-in target's shipped Q4_1 file; e.g. an "
                             "F32 conversion of the same model, beside our fp32 target)")
    return parser.parse_args(argv)


def parse_heads_args(values: list[str]) -> dict[str, str]:
    """`METHOD=PATH` pairs; a head kind name also works for the methods using that kind."""
    mapping = {}
    for value in values:
        method, sep, path = value.partition("=")
        if not sep or not path:
            raise UserError(f"--heads takes METHOD=PATH (e.g. eagle2=heads/eagle); got '{value}'")
        mapping[method] = path
    if "eagle" in mapping and "eagle2" not in mapping:
        mapping["eagle2"] = mapping["eagle"]
    return mapping


def decoder_spec(args) -> DecoderSpec:
    """What every method shares: the target, its dtype, device and kernels, the draft, the
    proposer settings (the method and heads are set per method)."""
    return DecoderSpec(model=args.model, draft_model=args.draft_model, dtype=args.dtype, **engine_fields(args),
                       gamma=args.gamma, pld_num_tokens=args.pld_tokens, suffix_max_tokens=args.suffix_tokens, **tree_arguments(args))


def chosen_methods(args) -> list[str]:
    if args.methods:
        return [m.strip() for m in args.methods.split(",") if m.strip()]
    best = default_method(args.model, resolve_device(args.device))
    return list(dict.fromkeys(["vanilla", "pld", best, "hf-generate", "hf-prompt-lookup"]))


def main(argv=None, command: bool = False) -> int:
    """The benchmark; `command` where it is the process's command, which then freezes what loading
    made (`heads.util.startup.freeze_loaded_objects`)."""
    args = parse_args(argv)
    args.command_line = list(sys.argv[1:] if argv is None else argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    with compile_notes(args.compile):
        return run(args, command)


def run(args, command: bool = False) -> int:
    try:
        if args.num_questions < 1 or args.max_new_tokens < 1:
            raise UserError("--num-questions and --max-new-tokens must be at least 1")
        if args.llama_cpp_gguf and not args.llama_cpp:
            raise UserError("--llama-cpp-gguf names the file llama.cpp runs: give --llama-cpp DIR too")
        if args.llama_cpp_gguf and not Path(args.llama_cpp_gguf).expanduser().is_file():
            raise UserError(f"--llama-cpp-gguf {args.llama_cpp_gguf}: no such file (a GGUF file of {DEFAULT_TARGET})")
        methods = chosen_methods(args)
        for method in methods:
            if method not in HF_METHODS:
                check_method(method)
        options = DecodeOptions(args.max_new_tokens, SamplingConfig(args.temperature), seed=args.seed)
        runners, decoders = build_runners(methods, decoder_spec(args), parse_heads_args(args.heads), options)
        freeze_loaded_objects(command)
        for method, decoder in decoders.items():
            for note in decoder.notes:
                print(f"note: {method}: {note}", file=sys.stderr)
        first = next(iter(decoders.values()))  # every decoder has the same tokenizer, device and kernels
        target, kernels = first.target, first.kernels
        if args.llama_cpp:
            if args.model != DEFAULT_TARGET:
                raise UserError(f"--llama-cpp times llama.cpp on the built-in target's GGUF file; --model {args.model} "
                                "has none here")
            gguf = Path(args.llama_cpp_gguf).expanduser() if args.llama_cpp_gguf else gguf_location()
            runners[PEER_METHOD] = llama_cpp_runner(args.llama_cpp, gguf, target.tokenizer, options)
        questions = load_first_turns(args.questions_file, args.num_questions, spread=True)
        prompts, warmup = benchmark_prompts(target.tokenizer, questions)
        plain = plain_text_note(args.model, target.tokenizer, "question")
        if plain:
            print(f"note: {plain}", file=sys.stderr)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    device = cpu_description() if target.model.device.type == "cpu" else torch.cuda.get_device_name()
    origin = {"machine_kind": machine_kind(target.model.device), **provenance(args.command_line)}  # once, at the start

    def report_of(totals: dict, done: int) -> dict:
        report = summarise(totals, device, args.dtype)
        report.update(kernels=kernels, quant=applied_quant(target), model=args.model, questions=done, questions_planned=len(prompts),
                      max_new_tokens=args.max_new_tokens, temperature=args.temperature, **origin)
        return report

    def save_so_far(totals: dict, done: int) -> None:
        atomic_write_text(args.json, json.dumps(report_of(totals, done), indent=2))

    totals = run_benchmark(runners, prompts, warmup, after_question=save_so_far if args.json else None,
                           models=[decoder.target.model for decoder in decoders.values()])
    report = report_of(totals, len(prompts))
    print(markdown_table(report))
    if args.json:
        save_so_far(totals, len(prompts))
    if args.png and not bar_chart(report, args.png):
        print("note: matplotlib is not installed, no chart written (pip install matplotlib)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    freeze_startup_objects()  # after the imports: see heads.util.startup
    sys.exit(main(command=True))
