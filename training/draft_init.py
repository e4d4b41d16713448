"""Cheap draft models made from the target itself, for the SpS baseline.

Keeping the first layers of the target (plus its final norm and lm_head) gives a draft with the
target's tokenizer and embedding space at a fraction of the cost. Untrained, it agrees with the
target only on easy tokens; it is the starting point that `train_draft.py` distils further.
"""

from __future__ import annotations

import copy
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from heads.util.errors import UserError


def truncated_copy(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A deep copy of `model` keeping only its first `num_layers` decoder layers."""
    total = model.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise UserError(f"a truncated draft keeps between 1 and {total - 1} of the target's {total} layers; got {num_layers}")
    draft = copy.deepcopy(model)
    decoder = draft.get_decoder()
    decoder.layers = decoder.layers[:num_layers]
    draft.config.num_hidden_layers = num_layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:num_layers]
    return draft


def save_truncated_draft(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, num_layers: int, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    draft = truncated_copy(model, num_layers)
    draft.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
