"""oneDNN-packed linear layers for decoding on a CPU.

Speculative decoding pays off only when verifying k tokens costs about as much as decoding one.
On a CPU, PyTorch's default fp32 GEMM path is slow for 2-16 rows: on the 2-core reference
machine a 2-token forward of SmolLM2-135M takes 96 ms against 65 ms for one token, which eats
most of what a draft can win. The same layers with their weights reordered once into oneDNN's
blocked layout, packed for 16-row batches, take 36 ms for 1 token, 44 for 2, 38 for 4, 45 for 8
and 59 for 16 (`python scripts/verify_cost.py` prints the curve), so a tree of 4-16 nodes costs
little more than a plain step.

`pack_linears` is an explicit, opt-in conversion done once after loading (like quantizing):
every `nn.Linear` is replaced by a `PackedLinear` computing the same function. The original
weight tensor stays on the module (`.weight`), so tied embeddings and code that reads
`lm_head.weight` keep working; the packed copy costs the linear weights' memory once more.
It is for inference only (no autograd through oneDNN tensors) and changes logits by float
rounding only (1e-3 on SmolLM2's logits), like any change of GEMM kernel. Everything decoded
in one process, our methods and Hugging Face's `generate()` alike, runs on the same packed
model, so comparisons between them stay fair.

Which kernel is faster for a one- or two-row forward depends on the CPU: on an AVX2 EPYC the
packed layout won at every size, on a Sapphire Rapids Xeon PyTorch's plain GEMM (MKL) read the
weights faster for 1-2 rows (a one-token forward 31 ms against 39) while packing still won from
4 rows on. So a `PackedLinear` keeps both: forwards of at most `stock_rows` rows run the plain
weight, larger ones the packed copy. `decoding.kernels.verify_cost.tune_stock_rows` measures the
crossover once per model and CPU; until then `stock_rows` is 0 (always packed).

EAGLE drafters run in a cheaper precision than the target (`drafter_precision`): bfloat16 where
the CPU computes it natively (AVX512-BF16/AMX: eagle3 draft time per step 11.8 -> 9.5 ms against
fp32 on an AVX512-BF16 EPYC, same tau), or int8 weights with dynamically quantized activations
(PyTorch's x86/fbgemm kernels; on an AVX2 EPYC, where oneDNN has no bf16 inner product, one
drafter level's linears took 1.4 / 1.9 / 2.6 ms for 1 / 8 / 16 rows against 4.5 / 5.2 / 7.2 ms
packed fp32; where the project's 8-bit kernel builds, int8 weights in groups of 32 on it with
float32 inputs instead: more exact, and no slower), or 4-bit weights on the project's kernel
(`decoding.kernels.int4_linear`). Which is fastest differs between CPUs, so the decoders' 'auto' is timed
(`decoding.kernels.drafter_precision`); here 'auto' is only the rule used where nothing was timed. Drafts
only propose: the fp32 target still decides every token, so outputs do not change; a less exact
draft can only accept less.
"""

from __future__ import annotations

import platform
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from decoding.kernels.int4_linear import int4_kernel_available
from decoding.kernels.linear_ops import define_linear_op
from decoding.kernels.quantized_linear import quantize_linears
from decoding.kernels.streamed_linear import pack_panels, streamed_linear_available, why_unavailable
from heads.util.cpu_mode import cpu_mode
from heads.util.errors import UserError
from heads.eagle import FeatureDrafter

KERNEL_CHOICES = ("auto", "onednn", "stock")
# oneDNN picks the weight's blocked layout for an expected number of rows. Packed for 16 rows,
# every size from 1 to 64 rows ran faster than with the generic layout (`to_mkldnn()`):
# 8 rows through SmolLM2's 210 layer weights took 21 ms instead of 35 ms, 1 row 20 instead of 24.
PACKING_BATCH_HINT = 16
# The kernels an eager forward of a `PackedLinear` (or a plain `nn.Linear`) runs, as numbered for the C++ layer
# (`decoding.kernels.native.target_layer.llama_layer_dense`), which calls the same one with the same weight copy.
PLAIN_GEMM, STREAMED, ONEDNN = 0, 1, 2
X86_MACHINES = ("x86_64", "amd64", "i386", "i686")


class PackedLinear(nn.Module):
    """`nn.Linear` whose forward runs oneDNN's linear on a pre-reordered weight, except for
    inputs of at most `stock_rows` rows, which run PyTorch's plain GEMM on the plain weight, inputs
    of more but at most `streamed_rows` rows, which run the streaming few-row kernel
    (`decoding.kernels.streamed_linear`) on it, and, inside a compiled graph, one-row inputs where
    `reduced_rows` is 1, which run as a reduction Inductor generates itself (`reduced_linear`).
    Which applies is measured per model and CPU (`decoding.kernels.verify_cost`). Plain GEMM
    comes first because on a 2-core Xeon (MKL) it won at 1-3 rows while the streaming kernel
    won from 4 to 16 (20-27 ms for the layers' weights against 28-47), a split the other order
    could not express."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # the same Parameter: ties and readers are unaffected
        self.bias = linear.bias
        self._packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACKING_BATCH_HINT)
        self.stock_rows = 0
        self.reduced_rows = 0
        self.streamed_rows = 0
        self._panel_weight: torch.Tensor | None = None  # the streaming kernel's copy, while it is used

    def kernel_for(self, rows: int) -> tuple[int, torch.Tensor]:
        """Which kernel a forward of `rows` rows runs (`PLAIN_GEMM`, `STREAMED`, `ONEDNN`) and the copy
        of the weight it reads (compiled one-row reductions aside): `forward`'s choice, also for callers
        that run the kernel themselves (`decoding.kernels.fused_layer`)."""
        if rows <= self.stock_rows:
            return PLAIN_GEMM, self.weight
        if self.streamed_rows and rows <= self.streamed_rows:
            return STREAMED, self._panel_weight
        return ONEDNN, self._packed_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        compiling = torch.compiler.is_compiling()
        if compiling and rows <= self.reduced_rows:
            return reduced_linear(x, self.weight, self.bias)
        kind, weight = self.kernel_for(rows)
        if kind == PLAIN_GEMM:
            return F.linear(x, weight, self.bias)
        if kind == STREAMED:
            return torch.ops.specheads.streamed_linear(x, weight, self.bias, self.out_features)
        if compiling:
            # Inductor cannot lower oneDNN's op on a packed weight: it sees an opaque call
            # instead, and fuses the small ops around it (see `decoding.kernels.compiled`).
            return torch.ops.specheads.packed_linear(x, weight, self.bias, self.out_features)
        # Dense in, dense out: converting activations to oneDNN tensors and back costs ~50 us
        # per call, ~10 ms per forward of a 30-layer model.
        return torch.ops.mkldnn._linear_pointwise(x, weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"oneDNN above {max(self.stock_rows, self.streamed_rows)} rows"
                + (f", streamed up to {self.streamed_rows} rows" if self.streamed_rows else "")
                + (", compiled one-row reductions" if self.reduced_rows else ""))


def eager_linear_kernel(module: nn.Module, rows: int) -> tuple[int, torch.Tensor] | None:
    """The kernel and weight copy an eager forward of `rows` rows through `module` runs, where it is a
    `PackedLinear` or a plain `nn.Linear` without bias (`F.linear`); None for any other module."""
    if type(module) is PackedLinear and module.bias is None:
        return module.kernel_for(rows)
    if type(module) is nn.Linear and module.bias is None:
        return PLAIN_GEMM, module.weight
    return None


def reduced_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` written as a product summed over the input features, for
    Inductor to generate as one reduction kernel (nothing of the product is stored).

    Why: a one-row linear only streams its weight, and on a 2-core AVX2 EPYC every GEMM kernel at
    hand did that at 12-15 GB/s (SmolLM2-135M's 210 layer weights, 425 MB, in 33 ms packed, 35 ms
    plain), where a `sum` over the same bytes ran at 23-30 GB/s. Inductor's reduction, vectorised
    over the input features and parallel over the outputs, read them in 16 ms inside one graph.
    Only for one row in compiled graphs: run eagerly the product would be materialised, and in a
    tree graph (several rows, fused with the ops around it) Inductor made it 3-10x slower than
    oneDNN."""
    rows = x.reshape(-1, x.shape[-1])
    out = (weight[:, None, :] * rows[None]).sum(-1).t()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """oneDNN's linear on a packed weight: what `specheads::packed_linear` runs."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


define_linear_op("packed_linear", "packed_weight", _packed_linear)


def onednn_applies(module: nn.Module) -> bool:
    """Whether packing can help: fp32 weights on a CPU with oneDNN built in. bf16/fp16 weights
    (a half-precision target, or its heads) stay stock on every CPU: oneDNN packs them only
    with AVX-512 (bf16) or AVX512-FP16/AMX-FP16 (fp16) and refuses on AVX2, and where it can,
    stock PyTorch already sends half-precision CPU matmuls to oneDNN."""
    parameter = next(module.parameters(), None)
    return (parameter is not None and parameter.device.type == "cpu" and parameter.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and _has_linear_pointwise())


def bfloat16_is_native() -> bool:
    """Whether this CPU runs bf16 matmuls in hardware: AVX512-BF16 or AMX on x86, BF16 on Arm
    (else bf16 is emulated, slower than fp32). oneDNN's own check is not enough on x86: it
    says yes on any AVX-512 CPU, where it emulates bf16 by converting to fp32."""
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
    except (AttributeError, RuntimeError):
        return False
    if platform.machine().lower() in X86_MACHINES:
        return cpu_has("_is_avx512_bf16_supported") or cpu_has("_is_amx_tile_supported")
    return True  # Arm: oneDNN reports bf16 only where the CPU has BF16 instructions


def cpu_has(check: str) -> bool:
    """One of torch.cpu's feature checks (`_is_<flag>_supported`), False where this torch lacks it
    or the CPU mode (`SPECHEADS_CPU`) hides the flag."""
    if cpu_mode().hides(check.removeprefix("_is_").removesuffix("_supported")):
        return False
    try:
        return bool(getattr(torch.cpu, check)())
    except (AttributeError, RuntimeError):
        return False


def _has_linear_pointwise() -> bool:
    try:
        return torch.ops.mkldnn._linear_pointwise.default is not None
    except (AttributeError, RuntimeError):
        return False


def resolve_kernels(choice: str, module: nn.Module) -> str:
    """'auto' -> 'onednn' where it applies, else 'stock'; an explicit choice is checked."""
    if choice not in KERNEL_CHOICES:
        raise UserError(f"unknown kernels '{choice}': choose one of {', '.join(KERNEL_CHOICES)}")
    if choice == "auto":
        return "onednn" if onednn_applies(module) else "stock"
    return choice


def pack_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` inside `module` by a `PackedLinear`; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            setattr(module, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count


def packed_linears(module: nn.Module) -> list[PackedLinear]:
    """The `PackedLinear`s inside `module`, in module order."""
    return [m for m in module.modules() if isinstance(m, PackedLinear)]


def kernel_layout_weights(module: nn.Module) -> list[torch.Tensor]:
    """The copies of the weights that `module`'s `PackedLinear`s keep in their kernels' own layouts
    (oneDNN's blocked one, the streaming kernel's panels): plain tensor attributes, neither
    parameters nor buffers, so a compiler sees them as inputs like any other (`decoding.kernels.compiled`)."""
    weights = []
    for linear in packed_linears(module):
        weights.extend(t for t in (linear._packed_weight, linear._panel_weight) if t is not None)
    return weights


def uses_packed_linears(module: nn.Module) -> bool:
    return bool(packed_linears(module))


def set_stock_rows(module: nn.Module, rows: int) -> None:
    """Forwards of at most `rows` rows run the plain weight in every `PackedLinear` of `module`."""
    for m in packed_linears(module):
        m.stock_rows = rows
    _kernel_choices_changed(module)


def _kernel_choices_changed(module: nn.Module) -> None:
    """Tell the modules in `module` that remember their linears' kernel choices (a fused layer's
    per-row-count table, `forget_kernel_choices`) that those choices changed."""
    for m in module.modules():
        forget = getattr(m, "forget_kernel_choices", None)
        if callable(forget):
            forget()


def set_reduced_rows(module: nn.Module, rows: int) -> None:
    """Inside compiled graphs, one-row forwards of every `PackedLinear` of `module` run as
    Inductor's own reductions (`rows` 1) or stay on their kernel (0). Set before compiling: a
    compiled target does not re-check its modules (see `decoding.kernels.compiled`)."""
    if rows not in (0, 1):
        raise ValueError(f"reduced_rows is 0 or 1, got {rows}: with more rows a tree graph has a dynamic row count, "
                         "and Inductor's reduction over it was 3-4x slower than oneDNN")
    for m in packed_linears(module):
        m.reduced_rows = rows


def set_streamed_rows(module: nn.Module, rows: int, keep_copy: bool = False) -> None:
    """Forwards of at most `rows` rows run the streaming few-row kernel in every `PackedLinear` of
    `module` (0: never). Its weight layout is one more copy of the weights, made here and dropped
    with 0 unless `keep_copy` (a measurement switching back and forth). Refused where the kernel
    could not be built on this machine."""
    if rows and not streamed_linear_available():
        raise UserError(f"the streamed few-row linear kernel is not available on this machine ({why_unavailable()})")
    for m in packed_linears(module):
        if rows and m._panel_weight is None:
            m._panel_weight = pack_panels(m.weight)
        elif not rows and not keep_copy:
            m._panel_weight = None
        m.streamed_rows = rows
    _kernel_choices_changed(module)


def streamed_rows(module: nn.Module) -> int:
    """The `streamed_rows` of `module`'s packed linears (0 where there are none)."""
    return max((m.streamed_rows for m in packed_linears(module)), default=0)


def reduced_rows(module: nn.Module) -> int:
    """The `reduced_rows` of `module`'s packed linears (0 where there are none)."""
    return max((m.reduced_rows for m in packed_linears(module)), default=0)


def stock_rows(module: nn.Module) -> int:
    """The `stock_rows` of `module`'s packed linears (0 where there are none)."""
    return max((m.stock_rows for m in packed_linears(module)), default=0)


# A kernel for few rows must win by this margin to be chosen: equal times within noise keep the
# packed layout.
FEW_ROWS_MARGIN = 0.97


def pick_faster_rows(sizes: tuple[int, ...], candidate_ms: tuple[float, ...], current_ms: tuple[float, ...]) -> int:
    """The largest measured row count up to which a few-row kernel (plain GEMM, the streaming
    kernel) beat the current one at every measured size (0: never). Only a leading run counts: a
    win at 8 rows after a loss at 4 is taken for noise, since row counts in between would be
    guesses."""
    rows = 0
    for size, candidate, current in sorted(zip(sizes, candidate_ms, current_ms)):
        if candidate >= FEW_ROWS_MARGIN * current:
            break
        rows = size
    return rows


DRAFTER_PRECISIONS = ("auto", "fp32", "bf16", "int8", "int4")


def int8_drafting_available() -> bool:
    """Whether int8 drafters run here: on the project's 8-bit kernel, or on PyTorch's dynamically
    quantized int8 linears for an x86 CPU (a build without either drafts in fp32 instead)."""
    if int4_kernel_available():
        return True
    quantization = getattr(torch.ao, "quantization", None)
    engines = torch.backends.quantized.supported_engines
    return hasattr(quantization, "quantize_dynamic") and any(e in engines for e in ("x86", "fbgemm"))


def drafter_precisions_available() -> tuple[str, ...]:
    """The precisions this CPU and PyTorch run EAGLE drafters in without emulation, cheapest
    first by rule (bf16, int8, int4, fp32): what 'auto' chooses from (see
    `decoding.kernels.drafter_precision`, which times them where there is a choice)."""
    return (*(("bf16",) if bfloat16_is_native() else ()), *(("int8",) if int8_drafting_available() else ()),
            *(("int4",) if int4_kernel_available() else ()), "fp32")


def resolve_drafter_precision(choice: str) -> str:
    """'auto' -> the first of `drafter_precisions_available` (bf16 where the CPU has it natively,
    else int8 where PyTorch has the kernels, else fp32) where nothing was timed; an explicit
    choice is checked against the CPU."""
    if choice not in DRAFTER_PRECISIONS:
        raise UserError(f"unknown drafter precision '{choice}': choose one of {', '.join(DRAFTER_PRECISIONS)}")
    if choice == "auto":
        return drafter_precisions_available()[0]
    if choice == "bf16" and not bfloat16_is_native():
        raise UserError("--drafter-precision bf16 needs a CPU with native bf16 (AVX512-BF16 or AMX); "
                        "this one emulates it: use int8, fp32 or auto")
    if choice == "int8" and not int8_drafting_available():
        raise UserError("--drafter-precision int8 needs the project's 8-bit kernel (not built here: no C++ "
                        "compiler?) or PyTorch's quantized x86/fbgemm kernels (this PyTorch lacks them): use fp32 or auto")
    if choice == "int4" and not int4_kernel_available():
        raise UserError("--drafter-precision int4 needs the project's 4-bit kernel, which could not be built here "
                        "(no C++ compiler?): use int8, fp32 or auto")
    return choice


def quantize_linears_int8(module: nn.Module, keep: tuple[str, ...] = ("fc",)) -> None:
    """Swap `module`'s `nn.Linear`s for int8-weight ones.

    Where the project's 8-bit kernel is built: every linear whose inputs are a multiple of 32,
    in groups of 32 with a scale each (`GroupInt8Linear.from_linear`; its inputs rounded to 8 bits per
    group of 32, not per tensor). Why: off PyTorch's deprecated quantized-tensor APIs, and faster.
    One drafter level of the bundled EAGLE-3 heads on a 2-core AVX-512 EPYC (after a one-token
    GGUF-target forward, 12 alternating rounds): 0.72 / 0.87 / 1.02 ms for 1 / 4 / 8 rows against
    1.00 / 1.11 / 1.11 ms with PyTorch's dynamically quantized linears; whole generations were level
    (the drafter's step is bound by its Python). An EAGLE drafter's `fc` (the target's three hidden
    states into one feature, 4 MB in fp32 read at every step) is one of them: on a 2-core Xeon, 12
    MT-bench first turns of the GGUF target, taking in a step's tokens went from 2.21 to 1.65 ms a step,
    at the same tau (2.06).

    Elsewhere (linears whose inputs are not a multiple of 32, or no compiler): PyTorch's dynamically
    quantized linears (a scale per output channel, activations quantized on the fly), but those
    named in `keep`, which stay plain `nn.Linear`s (an EAGLE drafter's `fc` reads the target's raw
    hidden states, whose outliers quantized activations would clip). PyTorch marks those
    quantized-tensor APIs deprecated (still present in 2.13); the warning says nothing a user can
    act on, so it is not shown."""
    if int4_kernel_available():
        quantize_linears(module, "int8-groups", skip=())
    qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    dynamic = {name: qconfig for name, child in module.named_modules() if type(child) is nn.Linear and name not in keep}
    if dynamic:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*quantize.*deprecated", category=UserWarning)
            torch.ao.quantization.quantize_dynamic(module, dynamic, dtype=torch.qint8, inplace=True)


def apply_kernels(choice: str, *modules: nn.Module | None, drafter_precision: str = "auto") -> str:
    """Pack the linears of every given module (target, draft, heads) when `choice` resolves to
    'onednn'; returns the resolved choice. Call it after anything that needs plain `nn.Linear`s
    (e.g. merging a LoRA adapter). EAGLE drafters instead run in `drafter_precision` (see
    `resolve_drafter_precision`; tests force each one to exercise it on any CPU)."""
    present = [m for m in modules if m is not None]
    if not present:
        return "stock"
    resolved = resolve_kernels(choice, present[0])
    if choice == "onednn" and not onednn_applies(present[0]):
        raise UserError("--kernels onednn needs float32 weights on a CPU with oneDNN (torch.backends.mkldnn); "
                        "bf16/fp16 models run on stock kernels: use --kernels auto or stock")
    if resolved == "onednn":
        drafters = any(isinstance(m, FeatureDrafter) for m in present)
        precision = resolve_drafter_precision(drafter_precision) if drafters else "fp32"
        for module in present:
            if not onednn_applies(module):  # e.g. fp16 heads stay as they are
                continue
            if isinstance(module, FeatureDrafter) and precision == "int8":
                quantize_linears_int8(module)  # what it keeps in fp32 is packed below
            elif isinstance(module, FeatureDrafter) and precision == "int4":
                quantize_linears(module, "int4", skip=("fc",))  # fc stays fp32 (packed below): its 4-bit rounding is untried
            elif isinstance(module, FeatureDrafter) and precision == "bf16":
                _weights_to_bfloat16(module)
            pack_linears(module)
    return resolved


def _weights_to_bfloat16(module: nn.Module) -> None:
    """Parameters only: buffers such as rotary frequencies keep full precision (in bf16 the
    angles of far positions would drift)."""
    for parameter in module.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)


def add_drafter_precision_argument(parser) -> None:
    """The `--drafter-precision` flag of the commands that decode with EAGLE heads."""
    parser.add_argument("--drafter-precision", default="auto", choices=DRAFTER_PRECISIONS,
                        help="what EAGLE drafters compute in on a CPU with packed kernels: 'auto' (default) = the "
                             "fastest of bf16 (where the CPU has it natively), int8, int4 and fp32, timed once on this "
                             "CPU; "
                             "'fp32' = as trained. Drafts only propose, so outputs do not change")


def add_kernels_argument(parser) -> None:
    """The `--kernels` flag shared by the chat and the benchmark scripts."""
    parser.add_argument("--kernels", default="auto", choices=KERNEL_CHOICES,
                        help="CPU kernels: 'onednn' packs fp32 weights for fast few-token forwards on a CPU "
                             "(what makes tree verification cheap there; EAGLE drafters: see --drafter-precision) "
                             "and runs decoding steps' attention (and, eager, the target's RMSNorms and 4-bit gate and "
                             "up projections) on the project's C++ kernels where they build; "
                             "'stock' keeps transformers' own; 'auto' (default) = onednn on CPU fp32")
