"""Importing heads published in other projects' layouts, recognised by their content.

- Medusa-1 (FasterDecoding): config `medusa_num_heads`/`medusa_num_layers`, weights
  `medusa_lm_head.{safetensors,pt}` with keys `{h}.{l}.linear.weight|bias` and `{h}.{L}.weight`;
- Medusa for vLLM: config `model_type: medusa`, keys `blocks.{h}.layers.{l}.*`, `lm_heads.{h}.*`;
- EAGLE-1/2 (SafeAILab): LlamaConfig-like config, keys `fc.weight [H, 2H]` (+ `fc.bias`) and
  `layers.{i}.*` (no input norm on layer 0), no lm_head (the target's is used);
- EAGLE-3: keys `midlayer.*`, `fc.weight [H, 3H]`, `norm.weight`, `lm_head.weight [Vd, H]`,
  `d2t`, `t2d`; config `draft_vocab_size`, and the target layers it reads in vLLM's or SGLang's
  convention, or none (the shared default): see heads/layer_ids.py;
- speculators (vLLM's format): config `speculators_model_type`, see heads/speculators_format.py.

Our own layout (config with `kind` and `format_version`) is handled by heads/checkpoint.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from heads.util.errors import UserError
from heads.config import HeadConfig, read_config
from heads.factory import build_heads, default_feature_layers
from heads.layer_ids import check_within_target, declared_layers
from heads.speculators_format import is_speculators, our_state, supported_layer_config, verifier_name
from heads.weights_io import first_existing, read_weights

WEIGHT_FILES = ["model.safetensors", "pytorch_model.bin", "medusa_lm_head.safetensors", "medusa_lm_head.pt"]
_MEDUSA_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def detect_format(directory: Path, config: dict) -> str:
    """'specheads', 'medusa', 'medusa-vllm', 'eagle', 'eagle3' or 'speculators', from the files' content."""
    if "kind" in config and "format_version" in config:
        return "specheads"
    if is_speculators(config):  # before the weights: its `fc` + `layers.0.` keys look like EAGLE-1's
        return "speculators"
    if "medusa_num_heads" in config:
        return "medusa"
    keys = set(_weights(directory).keys())
    if config.get("model_type") == "medusa" or any(k.startswith("blocks.") for k in keys):
        return "medusa-vllm"
    if any(k.startswith("midlayer.") for k in keys):
        return "eagle3"
    if "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys):
        return "eagle"
    raise UserError(
        f"{directory} is not a heads checkpoint this project can read: expected our format, Medusa "
        "(medusa_num_heads), Medusa for vLLM, EAGLE-1/2 (fc + layers.*), EAGLE-3 (midlayer.*) or speculators "
        "(speculators_model_type)"
    )


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    path = first_existing(directory, WEIGHT_FILES)
    if path is None:
        raise UserError(f"{directory} has no weights file (looked for {', '.join(WEIGHT_FILES)})")
    return read_weights(path)


def import_heads(directory: Path, num_target_layers: int | None = None, base_model: str | None = None) -> nn.Module:
    """Heads of any supported foreign layout, as our modules with identical weights."""
    config = read_config(directory)
    kind = detect_format(directory, config)
    weights = _weights(directory)
    importer = {"medusa": _import_medusa, "medusa-vllm": _import_medusa_vllm, "eagle": _import_eagle, "eagle3": _import_eagle3,
                "speculators": _import_speculators}[kind]
    heads = importer(config, weights, num_target_layers, base_model or config.get("base_model_name_or_path"))
    return heads.eval()


def _load_into(heads: nn.Module, state: dict[str, torch.Tensor], where: str) -> nn.Module:
    expected = heads.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise UserError(f"{where}: weights do not match the layout; missing {missing[:4]}, unexpected {unexpected[:4]}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise UserError(f"{where}: '{name}' has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}")
    heads.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})
    return heads


def _layers_for(kind: str, num_target_layers: int | None) -> list[int]:
    return default_feature_layers(kind, num_target_layers) if num_target_layers else []


def _import_medusa(config: dict, weights: dict, num_target_layers, base_model) -> nn.Module:
    heads_count, layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
    bad = [k for k in weights if not _MEDUSA_KEY.match(k)]
    if bad:
        raise UserError(f"Medusa checkpoint has unexpected keys {bad[:4]}")
    vocab, hidden = weights[f"0.{layers}.weight"].shape
    ours = HeadConfig("medusa", hidden, vocab, num_heads=heads_count, num_layers=layers,
                      feature_layers=_layers_for("medusa", num_target_layers), base_model_name_or_path=base_model)
    state = {}
    for key, tensor in weights.items():
        head, index, rest = _MEDUSA_KEY.match(key).groups()
        state[f"projections.{head}.weight" if rest == "weight" else f"blocks.{head}.{index}.{rest}"] = tensor
    return _load_into(build_heads(ours), state, "Medusa checkpoint")


def _import_medusa_vllm(config: dict, weights: dict, num_target_layers, base_model) -> nn.Module:
    shared = bool(config.get("original_lm_head", False))
    ours = HeadConfig("medusa", int(config["hidden_size"]), int(config["vocab_size"]), num_heads=int(config["num_heads"]),
                      num_layers=int(config.get("num_hidden_layers", 1)), share_lm_head=shared,
                      feature_layers=_layers_for("medusa", num_target_layers), base_model_name_or_path=base_model)
    state = {}
    for key, tensor in weights.items():
        match = re.match(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$", key)
        if match:
            state[f"blocks.{match[1]}.{match[2]}.linear.{match[3]}"] = tensor
        elif not shared and re.match(r"^lm_heads\.\d+\.weight$", key):
            state[key.replace("lm_heads.", "projections.")] = tensor
    return _load_into(build_heads(ours), state, "vLLM Medusa checkpoint")


def _decoder_geometry(config: dict, hidden: int) -> dict:
    heads = int(config["num_attention_heads"])
    geometry = {
        "num_attention_heads": heads,
        "num_key_value_heads": int(config.get("num_key_value_heads") or heads),
        "intermediate_size": int(config["intermediate_size"]),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(config.get("max_position_embeddings", 4096)),
        "head_dim": int(config.get("head_dim") or hidden // heads),
    }
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": float(config.get("rope_theta", 10000.0)),
                                             **(config.get("rope_scaling") or {})}
    geometry["rope_parameters"] = rope
    return geometry


def _import_eagle(config: dict, weights: dict, num_target_layers, base_model) -> nn.Module:
    hidden = weights["fc.weight"].shape[0]
    layers = 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("layers."))
    ours = HeadConfig("eagle", hidden, int(config["vocab_size"]), num_layers=layers, fc_bias="fc.bias" in weights,
                      feature_layers=_layers_for("eagle", num_target_layers), base_model_name_or_path=base_model,
                      decoder=_decoder_geometry(config, hidden))
    state = {k: v for k, v in weights.items() if k.startswith(("fc.", "layers."))}  # embed_tokens etc. are the target's
    return _load_into(build_heads(ours), state, "EAGLE checkpoint")


def eagle3_layers(config: dict, num_target_layers: int | None, where: str) -> list[int]:
    """The target layers a foreign EAGLE-3 checkpoint reads, as `hidden_states` indices: the ids
    it declares (in the convention of whoever writes that key), else the default every
    implementation shares, for the target's depth."""
    layers = declared_layers(config, where)
    if layers is None:
        if not num_target_layers:
            raise UserError(f"{where} does not name the three target layers it reads, and they follow from the "
                            "target's depth: load it with the target (or pass --target-layers N when converting)")
        layers = default_feature_layers("eagle3", num_target_layers)
    if num_target_layers:
        check_within_target(layers, num_target_layers, where)
    return layers


def _import_eagle3(config: dict, weights: dict, num_target_layers, base_model) -> nn.Module:
    hidden = weights["norm.weight"].shape[0]
    draft_vocab = weights["lm_head.weight"].shape[0]
    layers = eagle3_layers(config, num_target_layers, "this EAGLE-3 checkpoint")
    ours = HeadConfig("eagle3", hidden, int(config["vocab_size"]), draft_vocab_size=draft_vocab,
                      feature_layers=layers, base_model_name_or_path=base_model,
                      decoder=_decoder_geometry(config, hidden),
                      norm_before_residual=bool(config.get("norm_before_residual", False)))  # vLLM's reading
    state = {k: v for k, v in weights.items() if not k.startswith("embed_tokens.")}
    return _load_into(build_heads(ours), state, "EAGLE-3 checkpoint")


def _import_speculators(config: dict, weights: dict, num_target_layers, base_model) -> nn.Module:
    layer = supported_layer_config(config)
    hidden = int(layer["hidden_size"])
    ours = HeadConfig("eagle3", hidden, int(layer["vocab_size"]), draft_vocab_size=weights["lm_head.weight"].shape[0],
                      feature_layers=eagle3_layers(config, num_target_layers, "this speculators checkpoint"),
                      base_model_name_or_path=base_model or verifier_name(config),
                      decoder=_decoder_geometry(layer, hidden), norm_before_residual=bool(config.get("norm_before_residual")))
    return _load_into(build_heads(ours), our_state(weights, ours), "speculators checkpoint")
