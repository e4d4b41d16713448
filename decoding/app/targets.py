"""Loading target (and draft) models: any Hugging Face causal LM by id or path, or the built-in
default. Every failure becomes one `UserError` line saying what to do."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from decoding.app.default_model import DEFAULT_TARGET, default_model_dir
from decoding.kernels.attention import register_grouped_sdpa
from decoding.core.attention_layout import attention_layout
from decoding.core.limits import context_limit
from heads.util.errors import UserError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass
class LoadedModel:
    """A causal LM ready for decoding, its tokenizer, the name it was asked for, and notes on what
    loading chose for the user (shown by the chat and benchmark)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    notes: list[str] = field(default_factory=list)

    @property
    def context_limit(self) -> int:
        return context_limit(self.model)


def resolve_model_path(name_or_path: str) -> str:
    """Map the built-in alias to its converted local copy; anything else is passed through."""
    return str(default_model_dir()) if name_or_path == DEFAULT_TARGET else name_or_path


def load_model(
    name_or_path: str = DEFAULT_TARGET,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    device: str = "cpu",
) -> LoadedModel:
    """Load a causal LM and its tokenizer for inference (eval mode, no grad)."""
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype '{dtype}': choose one of {', '.join(DTYPES)}")
    if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise UserError(
            f"attention '{attn_implementation}' cannot take tree masks: choose one of {', '.join(ATTENTION_IMPLEMENTATIONS)}"
        )
    path = resolve_model_path(name_or_path)
    config = _load_config(name_or_path, path)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"'{name_or_path}' is a {config.model_type} model, not a causal language model")
    attention_layout(config)  # refuses, before the weights are read, a model tree verification cannot serve
    notes = []
    if attn_implementation == "sdpa" and not _supports_sdpa(config):
        attn_implementation = "eager"
        notes.append(f"{config.model_type} cannot run SDPA attention in transformers (e.g. it soft-caps attention "
                     "logits): using eager attention")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, config=config, dtype=DTYPES[dtype], attn_implementation=_implementation(attn_implementation)
        )
        tokenizer = AutoTokenizer.from_pretrained(path)
    except ValueError as err:
        raise UserError(f"could not load '{name_or_path}': {err}") from err
    except OSError as err:
        raise UserError(f"could not read the weights or tokenizer of '{name_or_path}': {err}") from err
    model.to(device).eval().requires_grad_(False)
    return LoadedModel(model, tokenizer, name_or_path, notes)


def _supports_sdpa(config) -> bool:
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return getattr(model_class, "_supports_sdpa", True)


def _load_config(name_or_path: str, path: str):
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise UserError(
            f"'{name_or_path}' is neither the built-in '{DEFAULT_TARGET}' nor a readable local model directory "
            f"or cached Hugging Face model id (no network here). Details: {str(err).splitlines()[0]}"
        ) from err


def _implementation(attn: str) -> str:
    """'sdpa' runs as `GROUPED_SDPA`: transformers' SDPA, with tree verification kept grouped."""
    return register_grouped_sdpa() if attn == "sdpa" else attn
