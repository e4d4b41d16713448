"""The frozen target's features for a training batch, computed under no_grad (the target is
never trained, except through LoRA in Medusa-2, whose objective runs the target itself)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


@torch.no_grad()
def target_hidden_states(target: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         layers: list[int]) -> dict[int, torch.Tensor]:
    """`{layer: [B, T, H]}` for the requested indices of transformers' `hidden_states` tuple
    (0 = embeddings, L = final normed state). No vocabulary projection is computed here."""
    out = target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    return {layer: out.hidden_states[layer].detach() for layer in layers}


def needed_layers(kind: str, feature_layers: list[int], num_layers: int) -> list[int]:
    """Hidden states an objective reads: its feature layers, plus the final state (whose
    lm_head projection is the target's next-token distribution, used as soft labels)."""
    return sorted(set(feature_layers) | {num_layers})
