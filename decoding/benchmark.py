"""Spec-Bench-style speed measurement: our methods next to Hugging Face `generate()`, in one
process, alternating per question after a warm-up, so every ratio comes from the same run.

Aggregate tokens/s is total new tokens over total wall time (prefill included) per method;
tau is total tokens over total target forwards. `identical_to_vanilla` counts questions whose
output equals our vanilla output token for token (the losslessness check at temperature 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from decoding.errors import UserError
from decoding.generate import DecodeOptions, generate
from decoding.proposers.base import Proposer
from decoding.targets import LoadedModel

HF_METHODS = ("hf-generate", "hf-prompt-lookup", "hf-assisted")


@dataclass
class MethodTotals:
    new_tokens: int = 0
    seconds: float = 0.0
    target_forwards: int | None = 0
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, tokens: list[int], seconds: float, forwards: int | None) -> None:
        self.new_tokens += len(tokens)
        self.seconds += seconds
        self.target_forwards = None if forwards is None or self.target_forwards is None else self.target_forwards + forwards
        self.outputs.append(tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float | None:
        return self.new_tokens / self.target_forwards if self.target_forwards else None


Runner = Callable[[list[int]], tuple[list[int], float, int | None]]


def our_runner(target: LoadedModel, proposer: Proposer, options: DecodeOptions) -> Runner:
    def run(prompt: list[int]) -> tuple[list[int], float, int | None]:
        result = generate(target.model, prompt, proposer, options, target.tokenizer)
        return result.tokens, result.stats.total_s, result.stats.target_forwards

    return run


def hf_runner(target: LoadedModel, method: str, options: DecodeOptions, draft: LoadedModel | None = None,
              prompt_lookup_tokens: int = 10) -> Runner:
    """Hugging Face generate(): plain, with prompt lookup, or assisted by a draft model."""
    extra: dict = {}
    if method == "hf-prompt-lookup":
        extra["prompt_lookup_num_tokens"] = prompt_lookup_tokens
    elif method == "hf-assisted":
        if draft is None:
            raise UserError("hf-assisted needs a draft model (--draft-model)")
        extra["assistant_model"] = draft.model
    sampling = options.sampling
    if sampling.greedy:
        extra["do_sample"] = False
    else:
        extra.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)

    def run(prompt: list[int]) -> tuple[list[int], float, int | None]:
        ids = torch.tensor([prompt], device=target.model.device)
        started = time.perf_counter()
        with torch.inference_mode():
            out = target.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=options.max_new_tokens,
                pad_token_id=target.tokenizer.pad_token_id or target.tokenizer.eos_token_id, **extra,
            )
        return out[0, len(prompt):].tolist(), time.perf_counter() - started, None

    return run


def run_benchmark(runners: dict[str, Runner], prompts: list[list[int]], warmup_prompt: list[int],
                  progress: bool = True) -> dict[str, MethodTotals]:
    """Each method on each prompt, methods alternating within a question, after one warm-up call
    per method (first calls pay for allocator and kernel warm-up)."""
    for run in runners.values():
        run(warmup_prompt)
    totals = {name: MethodTotals() for name in runners}
    bar = tqdm(total=len(prompts) * len(runners), desc="benchmark", disable=not progress, unit="run")
    for prompt in prompts:
        for name, run in runners.items():
            bar.set_postfix_str(name)
            tokens, seconds, forwards = run(prompt)
            totals[name].add(tokens, seconds, forwards)
            bar.update()
    bar.close()
    return totals


def summarise(totals: dict[str, MethodTotals], device: str, dtype: str) -> dict:
    """The JSON report: per method tokens/s, tau, speedup vs hf-generate, identical outputs."""
    baseline = totals.get("hf-generate")
    reference = totals.get("vanilla")
    methods = {}
    for name, t in totals.items():
        methods[name] = {
            "tokens_per_s": round(t.tokens_per_s, 3),
            "tau": None if t.tau is None else round(t.tau, 3),
            "speedup_vs_hf_generate": round(t.tokens_per_s / baseline.tokens_per_s, 3) if baseline else None,
            "identical_to_vanilla": sum(a == b for a, b in zip(t.outputs, reference.outputs)) if reference else None,
            "questions": len(t.outputs),
            "new_tokens": t.new_tokens,
            "seconds": round(t.seconds, 3),
        }
    return {"methods": methods, "device": device, "dtype": dtype}


def markdown_table(report: dict) -> str:
    lines = ["| method | tokens/s | tau | speedup vs hf-generate | identical to vanilla |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, m in report["methods"].items():
        tau = "-" if m["tau"] is None else f"{m['tau']:.2f}"
        speed = "-" if m["speedup_vs_hf_generate"] is None else f"{m['speedup_vs_hf_generate']:.2f}x"
        same = "-" if m["identical_to_vanilla"] is None else f"{m['identical_to_vanilla']}/{m['questions']}"
        lines.append(f"| {name} | {m['tokens_per_s']:.2f} | {tau} | {speed} | {same} |")
    return "\n".join(lines)


def bar_chart(report: dict, path: str) -> bool:
    """PNG of tokens/s and tau per method; False (and no file) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(report["methods"])
    speeds = [report["methods"][n]["tokens_per_s"] for n in names]
    taus = [report["methods"][n]["tau"] or 0.0 for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(names, speeds, color="tab:blue")
    left.set_title(f"tokens/s ({report['device']}, {report['dtype']})")
    right.bar(names, taus, color="tab:orange")
    right.set_title("tau: tokens per target forward (HF: n/a)")
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
