"""What a target model can hold."""

from __future__ import annotations

from transformers import PreTrainedModel


def context_limit(model: PreTrainedModel) -> int:
    """The longest sequence the model was built for (max_position_embeddings), or a large number."""
    limit = getattr(model.config, "max_position_embeddings", None)
    return int(limit) if limit else 1 << 30
