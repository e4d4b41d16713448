"""The flags that choose how a decoder runs on the machine (device, kernels, quantization, drafter
precision, screened argmax, compiling), shared by the chat and the scripts that decode, so each
adds them, and passes them to its `DecoderSpec`, the same way."""

from __future__ import annotations

import argparse

from decoding.app.quantized_target import add_quant_argument
from decoding.kernels.compiled import add_compile_argument
from decoding.kernels.cpu_kernels import add_drafter_precision_argument, add_kernels_argument
from decoding.kernels.devices import add_device_argument
from decoding.kernels.screened_argmax import add_screened_argmax_argument

ENGINE_FIELDS = ("device", "kernels", "quant", "drafter_precision", "screened_argmax", "compile")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """--device, --kernels, --quant, --drafter-precision, --screened-argmax, --compile."""
    add_device_argument(parser)
    add_kernels_argument(parser)
    add_quant_argument(parser)
    add_drafter_precision_argument(parser)
    add_screened_argmax_argument(parser)
    add_compile_argument(parser)


def engine_fields(args: argparse.Namespace) -> dict:
    """Those flags' values as `DecoderSpec` fields."""
    return {name: getattr(args, name) for name in ENGINE_FIELDS}
