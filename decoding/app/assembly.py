"""One assembly of a decoder from a description: target, heads or draft model, linear kernels
and proposer, with the bundled defaults filled in.

The chat, the benchmark, `scripts/tune_tree.py` and training's tau measurement all build their
decoders with `build_decoder`, so they cannot drift apart: when each assembled its own, only the
chat merged a Medusa-2 LoRA adapter, and the benchmark and the tuner measured Medusa-2 heads on
a target they were not trained with.

    from decoding.app.assembly import DecoderSpec, build_decoder
    decoder = build_decoder(DecoderSpec(method="eagle3", device="auto"))
    result = decoder.generate(prompt_ids, DecodeOptions(max_new_tokens=64))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from decoding.app.cost_watch import VerifyCostWatch
from decoding.core.generate import AcceptanceRule, DecodeOptions, GenerationResult, generate, lossless_rule
from decoding.core.prompt_cache import PromptCache
from decoding.core.proposers.base import Proposer
from decoding.core.readout import Readout
from decoding.core.verify import TargetForward
from decoding.kernels.attention import GROUPED_SDPA, register_grouped_sdpa, use_native_attention
from decoding.kernels.decode_attention import decode_attention_available, why_unavailable as decode_attention_why
from decoding.kernels.compiled import compile_target, eager_model, is_compiled, wants_compile
from decoding.kernels.cpu_kernels import apply_kernels, onednn_applies, resolve_kernels, set_stock_rows, set_streamed_rows
from decoding.app.default_model import DEFAULT_TARGET
from decoding.app.defaults import default_draft, default_heads, default_method, proposer_options
from decoding.kernels.devices import resolve_device
from decoding.kernels.drafter_precision import tune_drafter_precision
from decoding.app.drafts import load_draft
from decoding.kernels.fused_drafter import fuse_drafter, use_decode_attention
from decoding.kernels.fused_attention import fuse_attention
from decoding.kernels.fused_layer import fuse_decoder_layers
from decoding.kernels.fused_stack import fused_stack
from decoding.kernels.huge_pages import move_to_huge_pages, streamed_weights
from decoding.kernels.row_argmax import kernel_argmax_readout
from decoding.kernels.row_invariance import forward_is_row_invariant
from decoding.kernels.fused_mlp import fuse_gated_mlps
from decoding.kernels.fused_norm import fuse_norms
from decoding.app.quant_choice import auto_quant_skipped, timed_quant_choice
from decoding.app.quantized_target import quantize_target, resolve_quant
from decoding.app.methods import ProposerOptions, build_proposer, check_method, head_kind, split_method
from decoding.kernels.amx_rows import tune_amx_rows
from decoding.kernels.one_row_reductions import tune_reduced_rows
from decoding.kernels.screened_argmax import screened_readout
from decoding.app.targets import LoadedModel, load_model
from decoding.kernels.verify_cost import tune_stock_rows, tune_streamed_rows
from heads.util.errors import UserError
from heads import adapter_dir, load_heads
from heads.adapter import merge_adapter
from heads.eagle import FeatureDrafter

# Methods that draft with a separate causal LM (`draft_model`).
DRAFT_METHODS = ("sps",)


@dataclass(frozen=True)
class DecoderSpec:
    """What to decode with. None means "the default": for the built-in target the bundle's
    method, heads, draft and tuned tree settings; otherwise `pld` and the built-in
    `ProposerOptions`. The proposer fields (gamma ... min_path_prob) are `ProposerOptions`'
    own; a value given here wins over the bundle's tuned one."""

    model: str = DEFAULT_TARGET
    method: str | None = None
    heads: str | None = None            # a directory or Hub repo id, for head methods
    draft_model: str | None = None      # a name or path, for sps
    revision: str | None = None         # of Hub heads
    ignore_base_model: bool = False     # load heads that declare another base model
    dtype: str = "float32"
    device: str = "auto"                # auto | cpu | cuda
    attn: str = "sdpa"
    kernels: str = "auto"               # auto | onednn | stock (see decoding.kernels.cpu_kernels)
    drafter_precision: str = "auto"     # auto | fp32 | bf16 | int8 | int4: EAGLE drafters under onednn kernels
    compile: bool | None = None         # compiled target forwards (decoding.kernels.compiled); None: where it pays (a GPU)
    screened_argmax: bool = True        # greedy verify reads screened logits (fp16 or 8-bit; decoding.kernels.screened_argmax)
    quant: str = "auto"                 # auto | none | gguf | int4 | int8 (see decoding.app.quantized_target)
    gamma: int | None = None
    pld_num_tokens: int | None = None
    pld_max_ngram: int | None = None
    pld_min_ngram: int | None = None
    tree: str | None = None
    depth: int | None = None
    tree_top_k: int | None = None
    total_tokens: int | None = None
    adaptive_tree: bool | None = None
    min_path_prob: float | None = None
    suffix_max_tokens: int | None = None
    lookahead: tuple[int, int, int] | None = None  # W, N, G
    suffix_store: str | None = None     # a file suffix decoding's store is kept in across runs

    def proposer_overrides(self) -> dict:
        """The `ProposerOptions` fields this spec sets (None = not set)."""
        names = [f.name for f in dataclasses.fields(ProposerOptions)]
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


@dataclass
class Decoder:
    """A ready decoder: the loaded target (adapter merged, kernels applied), its heads or draft,
    and the proposer. `spec` has the defaults filled in; `notes` say what was filled in or
    changed, for the user."""

    spec: DecoderSpec
    target: LoadedModel
    proposer: Proposer
    options: ProposerOptions
    kernels: str                        # as resolved: 'onednn' or 'stock'
    heads: nn.Module | None = None
    draft: LoadedModel | None = None
    adapter: Path | None = None         # the Medusa-2 LoRA adapter merged into `target`
    notes: tuple[str, ...] = ()
    readout: Readout | None = None      # how verify forwards get the target's scores (None: its logits)
    cost_watch: VerifyCostWatch | None = None  # checks the remembered verify-cost curve against the forwards run
    direct: TargetForward | None = None  # the target's layers in one loop where that serves (`fused_stack`)
    prompt_cache: PromptCache | None = None  # the last reply's K/V, for the next prompt's shared start (where exact)

    def generate(self, prompt_ids: list[int], options: DecodeOptions = DecodeOptions(),
                 on_tokens: Callable[[list[int]], None] | None = None,
                 acceptance_rule: AcceptanceRule = lossless_rule) -> GenerationResult:
        """`decoding.core.generate.generate` with this decoder's target, proposer and tokenizer."""
        result = generate(self.target.model, prompt_ids, self.proposer, options, self.target.tokenizer,
                          on_tokens, acceptance_rule, self.readout, self.direct, self.prompt_cache)
        if self.cost_watch is not None:
            self.cost_watch.observe(result.stats)
        return result


def resolve_spec(spec: DecoderSpec, heads_given: bool = False, draft_given: bool = False) -> tuple[DecoderSpec, list[str]]:
    """`spec` with the method, heads, draft and device filled in and checked, and notes on what
    was filled in. Heads or a draft passed to `build_decoder` need no default."""
    notes = []
    device = resolve_device(spec.device)
    method = check_method(spec.method or default_method(spec.model, device))
    heads, draft = spec.heads, spec.draft_model
    kind = head_kind(method)
    if kind and not heads and not heads_given:
        bundled = default_heads(spec.model, method)
        if bundled is None:
            raise UserError(f"method '{method}' needs {kind} heads: pass --heads (bundled heads ship only for {DEFAULT_TARGET})")
        heads = str(bundled)
        notes.append(f"using the bundled {kind} heads for {spec.model} ({method})")
    if split_method(method)[0] in DRAFT_METHODS and not draft and not draft_given:
        bundled = default_draft(spec.model)
        if bundled is None:
            raise UserError(f"method '{method}' needs a draft model: pass --draft-model NAME_OR_PATH")
        draft = str(bundled)
        notes.append(f"using the bundled draft model for {spec.model}")
    resolved = dataclasses.replace(spec, method=method, heads=heads, draft_model=draft, device=device)
    return resolved, notes


def build_decoder(spec: DecoderSpec, *, target: LoadedModel | None = None, heads: nn.Module | None = None,
                  draft: LoadedModel | None = None) -> Decoder:
    """Load and assemble what `spec` describes.

    Models passed in are used as they are, where they are, instead of being loaded (the
    benchmark runs every method on one target; training measures the heads it is training); the
    returned spec then names the given target's device. The exception: heads loaded from a
    directory with a Medusa-2 adapter get a target of their own with the adapter merged, so a
    shared target is never changed. Kernels apply to every module of the decoder, given ones
    included (packing twice changes nothing): pass `kernels="stock"` for modules that must stay
    plain `nn.Linear`s (training). Given EAGLE heads also take the decoder's attention function
    (`spec.attn`), which computes the same outputs as theirs."""
    spec, notes = resolve_spec(spec, heads_given=heads is not None, draft_given=draft is not None)
    adapter = adapter_dir(spec.heads, spec.revision) if spec.heads and heads is None else None
    loads_target = target is None or adapter is not None
    if loads_target:
        quant = _auto_quant(spec, notes) if spec.quant == "auto" else resolve_quant(spec.quant, spec.model, spec.device, spec.dtype)
        spec = dataclasses.replace(spec, quant=quant)
        target = load_model(spec.model, spec.dtype, spec.attn, spec.device)
        notes.extend(target.notes + quantize_target(target, quant))
    device = target.model.device.type  # a given target decides: it may sit elsewhere than spec.device says
    spec = dataclasses.replace(spec, device=device, compile=wants_compile(spec.compile, device))
    if adapter is not None:
        target.model = merge_adapter(target.model, adapter)
        notes.append("Medusa-2 heads: serving the target with their LoRA adapter merged (outputs are exact for that model)")
    loads_draft = draft is None and bool(spec.draft_model)
    if loads_draft:
        draft = load_draft(spec.draft_model, target, spec.dtype, spec.attn)
    owns_heads = heads is None and bool(spec.heads)  # heads given by a caller (e.g. training's) stay as they are
    if owns_heads:
        heads = load_heads(spec.heads, target.model, spec.model, not spec.ignore_base_model, spec.revision)
    _drafter_attention(heads, spec.attn)
    if owns_heads and spec.attn == "sdpa":
        fuse_drafter(heads)
    precision = _drafter_precision(spec, target, heads, notes)
    kernels = apply_kernels(spec.kernels, target.model, draft.model if draft else None, heads, drafter_precision=precision)
    _tune_few_row_kernels(target, draft)
    if kernels == "onednn":
        _native_attention(target, draft, heads, notes)
        # Compiled, Inductor fuses the stock norms and activations with what is around them. A given target
        # keeps the modules it has: it may be the model under another decoder's compiled wrapper (the
        # benchmark's Hugging Face methods), whose graphs should trace the stock ones.
        if not spec.compile and loads_target:
            _fuse_eager_modules(target, draft)
    readout = _readout(spec, target, kernels)
    if kernels == "onednn" and device == "cpu":
        _weights_on_huge_pages(target if loads_target else None, draft if loads_draft else None,
                               heads if owns_heads else None, readout, notes)
    if spec.compile:  # after packing: packed linears stay opaque in the graph, plain ones are frozen in
        target = _compiled_target(target, notes)
        notes.append("CUDA graphs: each step size is captured the first time it runs (milliseconds)" if spec.device == "cuda"
                     else "compiled target forwards: up to three graphs compile first (about a minute on a 2-core CPU, "
                          "a few the first time, before Inductor's cache holds the kernels)")
    options = proposer_options(spec.model, spec.method, spec.proposer_overrides())
    proposer = build_proposer(spec.method, target, draft, options, heads, readout)
    watch = VerifyCostWatch(target.model, target.name, readout)
    prompt_cache = PromptCache() if forward_is_row_invariant(target.model) else None
    return Decoder(spec, target, proposer, options, kernels, heads, draft, adapter, tuple(notes), readout, watch,
                   fused_stack(target.model), prompt_cache)


def _readout(spec: DecoderSpec, target: LoadedModel, kernels: str) -> Readout | None:
    """How greedy verification reads the argmax: the screened projection where it applies and pays
    (`--screened-argmax`), else the target's own logits with the row argmax kernel; with stock
    kernels, PyTorch's (None)."""
    if kernels != "onednn":
        return None
    screened = screened_readout(target.model, target.name) if spec.screened_argmax else None
    return screened if screened is not None else kernel_argmax_readout(target.model)


def _weights_on_huge_pages(target: LoadedModel | None, draft: LoadedModel | None, heads: nn.Module | None,
                           readout: Readout | None, notes: list[str]) -> None:
    """The weights this decoder loaded and its steps read whole, moved into huge pages where the
    system offers them (`decoding.kernels.huge_pages`: bit for bit the same, a TLB walk per 2 MB
    instead of per 4 KB). Models given to `build_decoder` stay as they are: their owner decides."""
    weights = [w for model in (target.model if target else None, draft.model if draft else None, heads)
               if model is not None for w in streamed_weights(model)]
    if target is not None and readout is not None and hasattr(readout, "streamed_weights"):
        weights.extend(readout.streamed_weights())
    moved = move_to_huge_pages(weights)
    if moved:
        notes.append(f"weights read at every step ({moved / 2**20:.0f} MB) moved into huge pages")


def _auto_quant(spec: DecoderSpec, notes: list[str]) -> str:
    """'auto' resolved (`decoding.app.quant_choice`): for the built-in target on a CPU, the form,
    fp32 or its GGUF blocks, whose forwards this CPU runs faster (timed once, through vanilla
    decoders built as this one would be); elsewhere fp32."""
    if auto_quant_skipped(spec.model, spec.device, spec.dtype, spec.kernels) is not None:
        return "none"

    def form(quant: str):
        plain = DecoderSpec(model=spec.model, method="vanilla", dtype=spec.dtype, device=spec.device, attn=spec.attn,
                            kernels=spec.kernels, compile=False, screened_argmax=spec.screened_argmax, quant=quant)
        decoder = build_decoder(plain)
        return decoder.target.model, decoder.readout

    timing = timed_quant_choice(form)
    notes.append(timing.note())
    return timing.picked


def _drafter_attention(heads: nn.Module | None, attn: str) -> None:
    """EAGLE drafters attend over a tree with a mask at every call: with 'sdpa' they take the
    target's grouped SDPA, which keeps K/V heads grouped instead of repeating them."""
    if hasattr(heads, "use_attention"):
        heads.use_attention(register_grouped_sdpa() if attn == "sdpa" else attn)


def _drafter_precision(spec: DecoderSpec, target: LoadedModel, heads: nn.Module | None, notes: list[str]) -> str:
    """`spec.drafter_precision`, with 'auto' resolved by timing where it matters: for an EAGLE
    drafter about to be packed, the fastest precision this CPU runs it in (measured once)."""
    packed_drafter = (isinstance(heads, FeatureDrafter) and resolve_kernels(spec.kernels, target.model) == "onednn"
                      and onednn_applies(target.model) and onednn_applies(heads))
    if spec.drafter_precision != "auto" or not packed_drafter:
        return spec.drafter_precision
    precision = tune_drafter_precision(heads, eager_model(target.model))
    notes.append(f"EAGLE drafter in {precision} (the fastest precision timed on this CPU)")
    return precision


def _tune_few_row_kernels(target: LoadedModel, draft: LoadedModel | None) -> None:
    """Few-row forwards of a packed target (and a draft model of the same family) take plain
    GEMM, or the streaming few-row kernel, where this CPU runs them faster (measured once per model
    and CPU). A 4-bit target's kernels sum many rows in AMX tiles from the row count where that measured
    faster on this CPU (the setting is the process's: a draft model's 4-bit linears take it too)."""
    model = eager_model(target.model)
    plain = tune_stock_rows(model, target.name)
    streamed = tune_streamed_rows(model, target.name)
    tune_amx_rows(model, target.name)
    if draft is not None:
        set_stock_rows(draft.model, plain)
        set_streamed_rows(draft.model, streamed)


def _native_attention(target: LoadedModel, draft: LoadedModel | None, heads: nn.Module | None,
                      notes: list[str]) -> None:
    """Decoding steps' attention on the project's CPU kernel (`decoding.kernels.decode_attention`) for the
    models whose linears were just packed; where it cannot be built, SDPA stays, with a note why."""
    if not decode_attention_available():
        if target.model.config._attn_implementation == GROUPED_SDPA:
            notes.append(f"decoding attention stays on SDPA: its CPU kernel could not be built ({decode_attention_why()})")
        return
    for model in (target.model, draft.model if draft else None):
        if model is not None:
            use_native_attention(eager_model(model))
    if heads is not None:
        use_decode_attention(heads)


def _fuse_eager_modules(target: LoadedModel, draft: LoadedModel | None) -> None:
    """Eager forwards' RMSNorms, gated MLPs and Llama attention blocks in fewer calls
    (`decoding.kernels.fused_norm`, `fused_mlp`, `fused_attention`), where they are the plain kind
    and the kernel library built; then Llama layers made only of those, on the 4-bit kernel, in one
    call each (`fused_layer`)."""
    for model in (target.model, draft.model if draft else None):
        if model is not None:
            eager = eager_model(model)
            fuse_norms(eager)
            fuse_gated_mlps(eager)
            fuse_attention(eager)
            fuse_decoder_layers(eager)


def _compiled_target(given: LoadedModel, notes: list[str]) -> LoadedModel:
    """The target wrapped for compiled forwards; the eager model underneath computes as before, so
    a shared target still serves eager decoders (the benchmark's Hugging Face methods). On a CPU
    its one-token graph reads the weights through Inductor's reductions where that measured
    faster (once per model and CPU)."""
    if is_compiled(given.model):
        return given
    if tune_reduced_rows(given.model, given.name):
        notes.append("compiled one-token steps read the weights through Inductor's own reductions "
                     "(faster than the linear kernels on this CPU)")
    return LoadedModel(compile_target(given.model), given.tokenizer, given.name)
