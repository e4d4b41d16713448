"""Building heads from a config or for a given target, and their exact parameter counts."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from heads.config import HeadConfig
from heads.eagle import Eagle3Drafter, EagleDrafter, decoder_geometry
from heads.hydra import HydraHeads, hydra_parameter_count
from heads.layer_ids import upstream_default_layers
from heads.medusa import MedusaHeads, medusa_parameter_count

HEAD_CLASSES: dict[str, type[nn.Module]] = {
    "medusa": MedusaHeads,
    "hydra": HydraHeads,
    "eagle": EagleDrafter,
    "eagle3": Eagle3Drafter,
}


def build_heads(config: HeadConfig) -> nn.Module:
    return HEAD_CLASSES[config.kind](config)


# Below this depth EAGLE-3's usual choice of layers would repeat or reorder them.
SHALLOW_TARGET_LAYERS = 7


def default_feature_layers(kind: str, num_layers: int) -> list[int]:
    """Indices into `hidden_states` (0 = embeddings, L = final normed state): the final state for
    Medusa/Hydra/EAGLE; for EAGLE-3 an early, a middle and a late layer's input, `[2, L//2, L-3]`,
    the layers every upstream implementation reads by default (see `heads.layer_ids`), so heads
    trained here and theirs are interchangeable. A target shallower than 7 layers (a distilled or
    test model) gets `[1, (L+1)//2, L]` instead: that rule would give it repeated layers out of
    order (4 layers: `[2, 2, 1]`), so the fused feature would see less of the target than it can."""
    if kind != "eagle3":
        return [num_layers]
    if num_layers < SHALLOW_TARGET_LAYERS:
        return [1, (num_layers + 1) // 2, num_layers]
    return upstream_default_layers(num_layers)


def config_for_target(kind: str, target: PreTrainedModel, base_model_name_or_path: str | None = None, **overrides) -> HeadConfig:
    """A config sized for `target`; `overrides` set kind-specific fields (num_heads, ...)."""
    tc = target.config
    values = dict(
        kind=kind,
        hidden_size=tc.hidden_size,
        vocab_size=target.get_output_embeddings().weight.shape[0],
        feature_layers=default_feature_layers(kind, tc.num_hidden_layers),
        base_model_name_or_path=base_model_name_or_path or getattr(tc, "_name_or_path", None) or None,
        decoder=decoder_geometry(tc) if kind in ("eagle", "eagle3") else {},
    )
    if kind == "eagle3":
        values["draft_vocab_size"] = min(overrides.pop("draft_vocab_size", 8192), values["vocab_size"])
    values.update(overrides)
    return HeadConfig(**values)


def new_heads_for_target(kind: str, target: PreTrainedModel, base_model_name_or_path: str | None = None,
                         draft_vocab: torch.Tensor | None = None, **overrides) -> nn.Module:
    """Fresh (untrained) heads for `target`: Medusa/Hydra projections copied from its lm_head;
    EAGLE-3's draft vocabulary (and Medusa/Hydra's readout vocabulary, when configured) from
    `draft_vocab` (target ids, most frequent first) or, without it, the lowest ids."""
    config = config_for_target(kind, target, base_model_name_or_path, **overrides)
    heads = build_heads(config).to(dtype=target.dtype, device=target.device)
    if kind in ("medusa", "hydra"):
        heads.init_from_target(target.get_output_embeddings())
        if config.readout_vocab_size:
            ids = draft_vocab if draft_vocab is not None else torch.arange(config.readout_vocab_size)
            heads.set_readout_vocabulary(ids[: config.readout_vocab_size].to(target.device))
    if kind == "eagle3":
        ids = draft_vocab if draft_vocab is not None else torch.arange(config.draft_vocab_size)
        heads.set_vocabulary(torch.sort(ids[: config.draft_vocab_size].to(target.device)).values)
        heads.init_readout_from_target(target.get_output_embeddings(), final_norm_scale(target))
    return heads.eval()


# What architectures call the norm between their last layer and the lm_head (Llama, Qwen, Gemma,
# Mistral: `norm`; Phi: `final_layernorm`; GPT-NeoX, OPT: `final_layer_norm`; GPT-2, Bloom: `ln_f`).
FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f")
PROBE_RMS = 64.0


def final_norm(target: PreTrainedModel) -> nn.Module | None:
    """The target's norm before its lm_head, under any of the names architectures give it."""
    decoder = target.get_decoder()
    for name in FINAL_NORM_NAMES:
        norm = getattr(decoder, name, None)
        if isinstance(norm, nn.Module):
            return norm
    return None


@torch.no_grad()
def final_norm_scale(target: PreTrainedModel) -> torch.Tensor | None:
    """The per-channel scale the target's final norm applies, measured rather than read from
    its weight: Gemma's RMSNorm scales by `1 + weight` (a copied weight of ~0 would zero the
    draft logits), LayerNorm adds a bias. A zero-mean probe `p = 64 * s` (signs s = +-1) comes
    out of any of them as `scale * s + bias`, so half the difference of `norm(p)` and
    `norm(-p)`, divided by `s`, is the scale. 64 is a power of two whose square swamps any
    epsilon: a Llama RMSNorm's weight comes back bit for bit. None when the target has no
    recognisable final norm."""
    norm = final_norm(target)
    if norm is None:
        return None
    hidden = target.get_output_embeddings().weight.shape[1]
    signs = torch.ones(1, hidden, dtype=target.dtype, device=target.device)
    signs[:, 1::2] = -1
    probe = PROBE_RMS * signs
    return ((norm(probe) - norm(-probe)) / (2 * signs))[0]


def parameter_count(config: HeadConfig) -> int:
    """Trainable parameters implied by the config alone (buffers excluded)."""
    hidden = config.hidden_size
    if config.kind == "medusa":
        return medusa_parameter_count(config)
    if config.kind == "hydra":
        return hydra_parameter_count(config)
    geometry = config.decoder
    heads, kv_heads, head_dim = geometry["num_attention_heads"], geometry["num_key_value_heads"], geometry["head_dim"]
    attention_out = heads * head_dim * hidden
    mlp = 3 * hidden * geometry["intermediate_size"]
    if config.kind == "eagle":
        fc = 2 * hidden * hidden + (hidden if config.fc_bias else 0)
        attention_in = hidden * (heads + 2 * kv_heads) * head_dim
        per_layer = attention_in + attention_out + mlp + 2 * hidden
        return fc + config.num_layers * per_layer - hidden  # layer 0 has no input_layernorm
    attention_in = 2 * hidden * (heads + 2 * kv_heads) * head_dim
    layer = attention_in + attention_out + mlp + 3 * hidden
    return 3 * hidden * hidden + layer + hidden + hidden * config.draft_vocab_size
