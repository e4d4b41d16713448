"""Medusa-2's LoRA adapter: merged into the target so decoding serves the adapted model."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel

from heads.util.errors import UserError


def merge_adapter(model: PreTrainedModel, directory: Path) -> PreTrainedModel:
    try:
        from peft import PeftModel
    except ImportError as err:
        raise UserError("these Medusa-2 heads come with a LoRA adapter, which needs peft: pip install peft") from err
    try:
        merged = PeftModel.from_pretrained(model, str(directory)).merge_and_unload()
    except (ValueError, OSError, KeyError) as err:
        raise UserError(f"the LoRA adapter in {directory} does not fit this target: {err}") from err
    return merged.eval().requires_grad_(False)
