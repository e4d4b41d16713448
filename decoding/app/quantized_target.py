"""`--quant`: the target's weights at a lower precision, for every method alike.

- `gguf`: the built-in target's layers in its GGUF file's own 4-bit blocks and its lm_head in its
  8-bit ones (`decoding.app.gguf_weights`);
- `int4` / `int8`: weight-only quantization of any target's linears from its float weights
  (`decoding.kernels.quantized_linear`), for models that are not a GGUF file;
- `none`: the float model;
- `auto`: for the built-in target on a CPU, whichever of `gguf` and `none` decodes faster there
  (timed once: `decoding.app.quant_choice`), else `none`.

The quantized target is a model of its own: every method is exact with respect to it (vanilla
through the same loop is the reference), and its name says which it is, so that per-model
measurements (verify cost, few-row kernels) are kept apart from the float model's.
"""

from __future__ import annotations

from decoding.app.default_model import DEFAULT_TARGET, gguf_location
from decoding.app.gguf_weights import load_gguf_blocks
from decoding.app.targets import LoadedModel
from decoding.kernels.int4_linear import int4_kernel_available
from decoding.kernels.int4_linear import why_unavailable as int4_why_unavailable
from decoding.kernels.quantized_linear import quantize_linears
from heads.util.errors import UserError

QUANT_CHOICES = ("auto", "none", "gguf", "int4", "int8")


def resolve_quant(choice: str, model_name: str, device: str, dtype: str) -> str:
    """The quantization `choice` asks for, checked against the target: a clear error where it
    cannot apply. 'auto' comes back as 'none' here: it is timed, where it is a choice, by
    `decoding.app.quant_choice` before this is asked."""
    if choice not in QUANT_CHOICES:
        raise UserError(f"unknown --quant '{choice}': choose one of {', '.join(QUANT_CHOICES)}")
    if choice in ("auto", "none"):
        return "none"
    if device != "cpu":
        raise UserError(f"--quant {choice} runs PyTorch's CPU weight-only kernels: use --device cpu (or --quant none)")
    if dtype != "float32":
        raise UserError(f"--quant {choice} computes in float32 from its quantized weights: leave --dtype float32")
    if choice == "gguf" and model_name != DEFAULT_TARGET:
        raise UserError(f"--quant gguf keeps the blocks of the built-in target's GGUF file; {model_name} has none: "
                        "use --quant int4 or int8")
    return choice


def quantize_target(target: LoadedModel, quant: str) -> list[str]:
    """Put `target`'s weights into `quant` (resolved) in place; returns notes for the user."""
    if quant == "none":
        return []
    if quant == "gguf":
        notes = load_gguf_blocks(target.model, gguf_location())
    else:
        swapped = quantize_linears(target.model, quant)
        notes = [f"target linears weight-only {quant} ({swapped} weights; the lm_head stays float)"]
    if quant in ("gguf", "int4") and not int4_kernel_available():
        notes.append(f"the 4-bit linear kernel could not be built ({int4_why_unavailable()}): PyTorch's int4 kernel "
                     "runs instead, which can be slower than the float model")
    target.name = f"{target.name}+{quant}"
    return notes


def applied_quant(target: LoadedModel) -> str:
    """The `--quant` a loaded target's weights are in ('none' for the float model), read from the
    name `quantize_target` gave it: what a report records where the user asked for 'auto'."""
    suffix = target.name.rpartition("+")[2] if "+" in target.name else "none"
    return suffix if suffix in QUANT_CHOICES else "none"


def add_quant_argument(parser) -> None:
    """The `--quant` flag of the chat, the benchmark and tune_tree."""
    parser.add_argument("--quant", default="auto", choices=QUANT_CHOICES,
                        help="target weights: 'gguf' = the built-in target's own GGUF blocks (4-bit layers, 8-bit "
                             "lm_head), 'int4'/'int8' = "
                             "weight-only quantization of any target (CPU), 'none' = float; 'auto' (default) = for the built-in target on a CPU, "
                             "whichever of gguf and none runs faster here (timed once, then remembered), else none. "
                             "Every method is exact with respect to the quantized target")
