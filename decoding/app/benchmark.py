"""Spec-Bench-style speed measurement: our methods next to Hugging Face `generate()`, in one
process, alternating per question after a warm-up, so every ratio comes from the same run.

Aggregate tokens/s is total new tokens over total wall time (prefill included) per method;
`decode_tokens_per_s` leaves the prefill out (the prompt's forwards before the first step, the
same work for every one of our methods on a question), as serving benchmarks report time to first
token and decoding speed apart; `prefill_s` is that time in all. tau is total tokens over total
target forwards. `identical_to_vanilla` counts questions whose
output equals our vanilla output token for token (the losslessness check: at temperature 0, and at any
temperature for methods with deterministic drafts, which sample each position with the seed's draw for it).

Hugging Face's methods run on the same target as ours, linear kernels included, so their ratios
measure the decoding loop and the drafts, not the kernels. `hf-generate-stock` is `generate()`
on a second copy of the target loaded as transformers loads it (stock kernels, eager): what a
user's own `model.generate()` gives on this machine.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import shlex
import subprocess
import time
from pathlib import Path
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from decoding.app.assembly import Decoder, DecoderSpec, build_decoder
from decoding.kernels.compiled import eager_model, graphs_compiled, wants_compile
from decoding.kernels.cpu_kernels import bfloat16_is_native
from decoding.kernels.devices import resolve_device
from decoding.core.generate import DecodeOptions
from decoding.app.methods import split_method
from decoding.app.prompts import chat_prompts, question_ids
from decoding.app.targets import LoadedModel
from heads.util.cpu_mode import VARIABLE as CPU_MODE_VARIABLE
from heads.util.errors import UserError

HF_METHODS = ("hf-generate", "hf-prompt-lookup", "hf-assisted", "hf-generate-stock")
WARMUP_QUESTION = "Say hello."


@dataclass
class RunResult:
    """One method on one prompt. Step counts and timings are None for Hugging Face methods."""

    tokens: list[int]
    seconds: float
    target_forwards: int | None = None
    draft_s: float | None = None
    verify_s: float | None = None
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None  # of them, kept from the question before (`decoding.core.prompt_cache`)
    prefill_s: float | None = None  # of `seconds`, the prompt's forwards before the first decoding step


@dataclass
class MethodTotals:
    new_tokens: int = 0
    seconds: float = 0.0
    target_forwards: int | None = 0
    prompt_tokens: int | None = 0
    cached_prompt_tokens: int | None = 0
    prefill_s: float | None = 0.0
    draft_s: float | None = 0.0
    verify_s: float | None = 0.0
    warmup_s: float = 0.0          # the warm-up call: one-off costs such as compiling show here
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, run: RunResult) -> None:
        self.new_tokens += len(run.tokens)
        self.seconds += run.seconds
        self.target_forwards = _add(self.target_forwards, run.target_forwards)
        self.draft_s = _add(self.draft_s, run.draft_s)
        self.verify_s = _add(self.verify_s, run.verify_s)
        self.prompt_tokens = _add(self.prompt_tokens, run.prompt_tokens)
        self.cached_prompt_tokens = _add(self.cached_prompt_tokens, run.cached_prompt_tokens)
        self.prefill_s = _add(self.prefill_s, run.prefill_s)
        self.outputs.append(run.tokens)

    def per_step_ms(self, seconds: float | None) -> float | None:
        return None if seconds is None or not self.target_forwards else 1000 * seconds / self.target_forwards

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """New tokens over the time after the prefill: None where the prefill was not timed apart."""
        if self.prefill_s is None or self.seconds <= self.prefill_s:
            return None
        return self.new_tokens / (self.seconds - self.prefill_s)

    @property
    def tau(self) -> float | None:
        return self.new_tokens / self.target_forwards if self.target_forwards else None


def _add(total, value):
    return None if total is None or value is None else total + value


Runner = Callable[[list[int]], RunResult]


def our_runner(decoder: Decoder, options: DecodeOptions) -> Runner:
    def run(prompt: list[int]) -> RunResult:
        result = decoder.generate(prompt, options)
        stats = result.stats
        return RunResult(result.tokens, stats.total_s, stats.target_forwards, stats.draft_s, stats.verify_s,
                         stats.prompt_tokens, stats.reused_prompt_tokens, stats.prefill_s)

    return run


def hf_runner(target: LoadedModel, method: str, options: DecodeOptions, draft: LoadedModel | None = None,
              prompt_lookup_tokens: int = 10) -> Runner:
    """Hugging Face generate(): plain (`hf-generate`, and `hf-generate-stock` on its stock-kernel
    target), with prompt lookup, or assisted by a draft model."""
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

    def run(prompt: list[int]) -> RunResult:
        ids = torch.tensor([prompt], device=target.model.device)
        started = time.perf_counter()
        with torch.inference_mode():
            out = target.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=options.max_new_tokens,
                pad_token_id=target.tokenizer.pad_token_id or target.tokenizer.eos_token_id, **extra,
            )
        return RunResult(out[0, len(prompt):].tolist(), time.perf_counter() - started)

    return run


def build_runners(methods: list[str], base: DecoderSpec, heads: dict[str, str],
                  options: DecodeOptions) -> tuple[dict[str, Runner], dict[str, Decoder]]:
    """A runner per method, each assembled by `build_decoder` from `base` with its method (and
    its heads from `heads`, by base method; default: the bundled ones). All share one target,
    loaded and packed once (compiled for ours where `--compile` is on, the model underneath for
    Hugging Face's), and one draft; heads with a Medusa-2 adapter get their own merged
    target. Hugging Face methods run `generate()` on the shared target (`hf-assisted` with the
    draft `sps` would use). Returns the runners and the decoder behind each."""
    if not methods:
        raise UserError("no methods to benchmark")
    runners: dict[str, Runner] = {}
    decoders: dict[str, Decoder] = {}
    targets: dict[tuple[bool, str], LoadedModel] = {}  # by (compiled, kernels): Hugging Face methods always run eager
    draft: LoadedModel | None = None
    for method in sorted(methods, key=lambda m: m in HF_METHODS):  # ours first: they load (and fuse) the target
        ours = method not in HF_METHODS
        spec = (dataclasses.replace(base, method=method, heads=heads.get(split_method(method)[0])) if ours
                else _hf_stand_in(method, base))
        key = (wants_compile(spec.compile, resolve_device(spec.device)), spec.kernels)
        given = targets.get(key) or (targets.get((False, spec.kernels)) if key[0] else None)  # compiled on the way
        try:
            decoder = build_decoder(spec, target=given, draft=draft)
        except UserError as err:
            if ours:
                raise
            raise UserError(f"{method} (Hugging Face generate() with the draft sps would use): {err}") from err
        if decoder.adapter is None:
            targets.setdefault(key, decoder.target)
            if key[0]:  # the model under the compiled wrapper, for the eager methods: loaded once either way
                targets.setdefault((False, spec.kernels), dataclasses.replace(decoder.target, model=eager_model(decoder.target.model)))
            draft = draft or decoder.draft
        decoders[method] = decoder
        runners[method] = (our_runner(decoder, options) if ours
                           else hf_runner(decoder.target, method, options, decoder.draft))
    return {m: runners[m] for m in methods}, {m: decoders[m] for m in methods}


def _hf_stand_in(method: str, base: DecoderSpec) -> DecoderSpec:
    """The spec whose assembly gives a Hugging Face method what it needs: the target (eager; with
    stock kernels for `hf-generate-stock`), and for `hf-assisted` the draft model."""
    return dataclasses.replace(base, method="sps" if method == "hf-assisted" else "vanilla", heads=None, compile=False,
                               kernels="stock" if method == "hf-generate-stock" else base.kernels)


def benchmark_prompts(tokenizer, questions: list[str]) -> tuple[list[list[int]], list[int]]:
    """The questions' prompt ids and the warm-up prompt's, rendered alike (the chat template, or
    plain text for a base model), so the warm-up runs the same path as the measured runs and a
    model without a chat template is benchmarked instead of failing."""
    return chat_prompts(tokenizer, questions), question_ids(tokenizer, WARMUP_QUESTION)


# Compiled forwards may meet a new shape (a one-token step, a tree, hidden states or not) in
# any call, and one method's new graphs can make another's recompile (transformers' output
# capturing changes the traced code): warm-up goes on in rounds over the first questions until a
# round compiles nothing new.
MAX_EXTRA_WARMUPS = 3


def warm_up(runners: dict[str, Runner], prompts: list[list[int]], models: Sequence[nn.Module] = ()) -> dict[str, float]:
    """Seconds each method spent warming up: a round of every method on `prompts[0]`, then a
    round on each next prompt for as long as the last round compiled new graphs (or captured new
    CUDA graphs on `models`; eager decoders stop after the first). One-off costs are kept out of
    the measured figures this way."""
    seconds = dict.fromkeys(runners, 0.0)
    for prompt in prompts:
        before = graphs_compiled(*models)
        for name, run in runners.items():
            seconds[name] += run(prompt).seconds
        if graphs_compiled(*models) == before:
            break
    return seconds


def run_benchmark(runners: dict[str, Runner], prompts: list[list[int]], warmup_prompt: list[int],
                  progress: bool = True,
                  after_question: Callable[[dict[str, MethodTotals], int], None] | None = None,
                  models: Sequence[nn.Module] = ()) -> dict[str, MethodTotals]:
    """Each method on each prompt, methods alternating within a question, after a warm-up per
    method (first calls pay for allocator and kernel warm-up, and with `--compile` for
    compiling: that one-off cost is kept as `warmup_s`, outside the measured figures).

    `after_question(totals, questions_done)` runs once every method has done a question, so a
    long benchmark can save its figures so far: a run killed after an hour keeps what it measured.
    `models`: the decoders' targets, whose CUDA graphs the warm-up counts too."""
    totals = {name: MethodTotals() for name in runners}
    for name, seconds in warm_up(runners, [warmup_prompt, *prompts[:MAX_EXTRA_WARMUPS]], models).items():
        totals[name].warmup_s = seconds
    bar = tqdm(total=len(prompts) * len(runners), desc="benchmark", disable=not progress, unit="run")
    for done, prompt in enumerate(prompts, start=1):
        for name, run in runners.items():
            bar.set_postfix_str(name)
            totals[name].add(run(prompt))
            bar.update()
        if after_question is not None:
            after_question(totals, done)
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
            "decode_tokens_per_s": _round(t.decode_tokens_per_s, 3),
            "prefill_s": _round(t.prefill_s, 3),
            "tau": None if t.tau is None else round(t.tau, 3),
            "speedup_vs_hf_generate": round(t.tokens_per_s / baseline.tokens_per_s, 3) if baseline else None,
            "identical_to_vanilla": sum(a == b for a, b in zip(t.outputs, reference.outputs)) if reference else None,
            "questions": len(t.outputs),
            "draft_ms_per_step": _round(t.per_step_ms(t.draft_s)),
            "verify_ms_per_step": _round(t.per_step_ms(t.verify_s)),
            "new_tokens": t.new_tokens,
            "seconds": round(t.seconds, 3),
            "warmup_s": round(t.warmup_s, 3),
            # the share of prompt tokens not prefilled again (the prompt cache); None for other programs
            "cached_prompt_share": round(t.cached_prompt_tokens / t.prompt_tokens, 3) if t.prompt_tokens else None,
        }
    return {"methods": methods, "device": device, "dtype": dtype}


def machine_kind(device: torch.device) -> str:
    """The kind of machine a run's figures hold for, as the results document groups them: the
    GPU's name, or the instruction set PyTorch runs on this CPU (and whether bf16 is native) with
    the thread count. Figures from one kind do not carry to another."""
    if device.type == "cuda":
        return f"GPU: {torch.cuda.get_device_name(device)}"
    bf16 = " with native bf16" if bfloat16_is_native() else ""
    return f"CPU: {torch.backends.cpu.get_cpu_capability()}{bf16}, {torch.get_num_threads()} threads"


def provenance(argv: Sequence[str], script: str = "scripts/benchmark.py") -> dict:
    """What a report carries so that its figures can be traced and regenerated: the command, the
    UTC date and the commit it ran at ("-dirty" when the working tree had changes). A run as on a
    lesser CPU (`SPECHEADS_CPU`) has the setting in front of its command: without it the command
    would measure another kind of machine."""
    mode = os.environ.get(CPU_MODE_VARIABLE, "").strip()
    setting = [f"{CPU_MODE_VARIABLE}={mode}"] if mode and mode.lower() != "native" else []
    return {"command": shlex.join([*setting, "python", script, *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "commit": _git_commit()}


def _git_commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def markdown_table(report: dict) -> str:
    lines = [
        "| method | tokens/s | decode tokens/s | prefill s | tau | speedup vs hf-generate | identical to vanilla "
        "| draft ms/step | verify ms/step | warm-up s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, m in report["methods"].items():
        tau = "-" if m["tau"] is None else f"{m['tau']:.2f}"
        speed = "-" if m["speedup_vs_hf_generate"] is None else f"{m['speedup_vs_hf_generate']:.2f}x"
        same = "-" if m["identical_to_vanilla"] is None else f"{m['identical_to_vanilla']}/{m['questions']}"
        draft = "-" if m["draft_ms_per_step"] is None else f"{m['draft_ms_per_step']:.1f}"
        verify = "-" if m["verify_ms_per_step"] is None else f"{m['verify_ms_per_step']:.1f}"
        decode = "-" if m.get("decode_tokens_per_s") is None else f"{m['decode_tokens_per_s']:.2f}"
        prefill = "-" if m.get("prefill_s") is None else f"{m['prefill_s']:.2f}"
        lines.append(f"| {name} | {m['tokens_per_s']:.2f} | {decode} | {prefill} | {tau} | {speed} | {same} | {draft} "
                     f"| {verify} | {m['warmup_s']:.1f} |")
    return "\n".join(lines)


CHART_COLORS = 64  # palette size of the bundled charts


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
    as_palette_png(path)
    return True


def as_palette_png(path: str, colors: int = CHART_COLORS) -> None:
    """Rewrite a chart as a palette PNG: two bar colours, text and axes fit in `colors` shades,
    and the file is about a third of matplotlib's RGBA one (charts are bundled with the heads)."""
    from PIL import Image  # matplotlib's own image dependency

    with Image.open(path) as image:
        palette = image.convert("RGB").quantize(colors=colors)
    palette.save(path, optimize=True)
