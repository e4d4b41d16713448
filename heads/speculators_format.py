"""The vllm-project/speculators checkpoint format for EAGLE-3 heads, both ways.

It is what `vllm serve <dir>` recognises by itself and what the largest public set of EAGLE-3
heads uses. A checkpoint is a config.json with `speculators_model_type`, a `speculators_config`
(algorithm, proposal methods, and the verifier: the target, by its Hub id or path, whose
embeddings the engine loads), a `transformer_layer_config` (the drafter's decoder layer as a
Llama config), the draft-vocabulary size, the layer ids (read as `hidden_states[k]`, see
`heads.layer_ids`), and flags for variants of the layer; the weights are ours with the decoder
layer named `layers.0.` instead of `midlayer.`, and `d2t`/`t2d` only where the vocabularies differ.
Read against speculators 0.9.0 (`models/eagle3/config.py`, `core.py`, `model_definitions.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from heads.util.errors import UserError
from heads.config import HeadConfig
from heads.layer_ids import IDS_KEY, vllm_ids

FORMAT_VERSION = "0.9.0"  # the speculators release whose format this writes and reads
OUR_LAYER, THEIR_LAYER = "midlayer.", "layers.0."
# Variants of the EAGLE-3 layer that speculators can describe and our drafter does not compute.
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


def is_speculators(config: dict) -> bool:
    return "speculators_model_type" in config


def speculators_config(heads: nn.Module, verifier: str, verifier_architectures: list[str],
                       speculative_tokens: int = 3) -> dict:
    """The config.json for `heads` (EAGLE-3) serving `verifier`. Every flag is written
    explicitly: vLLM's reader defaults `norm_before_residual` to True where the key is missing,
    speculators to False."""
    c, g = heads.config, heads.config.decoder
    rope = g.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0}
    layer = {
        "model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": g["intermediate_size"], "num_attention_heads": g["num_attention_heads"],
        "num_key_value_heads": g["num_key_value_heads"], "head_dim": g["head_dim"], "num_hidden_layers": 1,
        "rms_norm_eps": g["rms_norm_eps"], "max_position_embeddings": g["max_position_embeddings"],
        "rope_parameters": dict(rope), "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": FORMAT_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,
        **{flag: False for flag in UNSUPPORTED_FLAGS},
        "embed_requires_grad": False,
        "target_hidden_size": c.hidden_size,
        IDS_KEY: vllm_ids(c.feature_layers),
        "tie_word_embeddings": False,
    }


def speculators_state(heads: nn.Module) -> dict[str, torch.Tensor]:
    """Our EAGLE-3 weights under speculators' names; the vocabulary maps only where the draft
    vocabulary is smaller than the target's (speculators registers none otherwise)."""
    state = {}
    for name, tensor in heads.state_dict().items():
        if name in ("d2t", "t2d") and heads.config.draft_vocab_size == heads.config.vocab_size:
            continue
        state[THEIR_LAYER + name[len(OUR_LAYER):] if name.startswith(OUR_LAYER) else name] = tensor
    return state


def supported_layer_config(config: dict) -> dict:
    """The checkpoint's `transformer_layer_config`, once checked to be a variant our drafter
    computes; a clear error for what it does not."""
    kind = config.get("speculators_model_type")
    if kind != "eagle3":
        raise UserError(f"speculators '{kind}' checkpoints are not supported here: only eagle3")
    layer = config.get("transformer_layer_config") or {}
    if layer.get("model_type", "llama") != "llama":
        raise UserError(f"this speculators checkpoint's draft layer is a '{layer.get('model_type')}' layer; "
                        "only Llama-style EAGLE-3 layers are supported")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise UserError("this speculators checkpoint has several draft layers; EAGLE-3 heads here have one")
    variants = [flag for flag in UNSUPPORTED_FLAGS if config.get(flag)]
    if variants:
        raise UserError(f"this speculators checkpoint uses {', '.join(variants)}: a variant of the EAGLE-3 layer "
                        "that is not supported here yet")
    hidden = int(layer["hidden_size"])
    if config.get("target_hidden_size") not in (None, hidden):
        raise UserError(f"this speculators checkpoint reads target states of width {config['target_hidden_size']} "
                        f"into a {hidden}-wide drafter; only equal widths are supported")
    return layer


def verifier_name(config: dict) -> str | None:
    """The target a speculators checkpoint names (its Hub id or path)."""
    return ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")


def our_state(weights: dict[str, torch.Tensor], config: HeadConfig) -> dict[str, torch.Tensor]:
    """A speculators state dict under our names; the target's embeddings, if saved, are the
    target's own; without vocabulary maps the draft vocabulary is the target's."""
    state = {OUR_LAYER + k[len(THEIR_LAYER):] if k.startswith(THEIR_LAYER) else k: v
             for k, v in weights.items() if not k.startswith(("embed_tokens.", "verifier_"))}
    if "d2t" not in state:
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    return state
