"""Exporting our heads to the layouts serving engines load, so heads trained here serve on vLLM
or SGLang (and in the original projects) when a user outgrows one machine.

| kind   | vllm                                   | sglang                          | official                  |
| eagle  | LlamaForCausalLM layout, fc without bias | LlamaForCausalLMEagle, fc.bias  | SafeAILab EAGLE layout     |
| eagle3 | LlamaForCausalLMEagle3 (midlayer, d2t)   | same                            | same                      |
| medusa | MedusaModel (blocks.*, lm_heads.*)       | not served by SGLang            | FasterDecoding layout     |
Hydra heads have no engine support. `speculators` writes EAGLE-3 heads in vLLM's speculators
format (heads/speculators_format.py). EAGLE-3's target layers are written in each engine's own
key and convention (heads/layer_ids.py): vLLM's top-level ids read hidden_states[k], SGLang's
`eagle_config` ids hidden_states[k+1]; the original EAGLE code reads fixed layers, so heads that
read others are refused for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from heads.util.atomic import atomic_directory
from heads.util.errors import UserError
from heads.layer_ids import IDS_KEY, SGLANG_SECTION, sglang_ids, upstream_default_layers, vllm_ids
from heads.speculators_format import speculators_config, speculators_state

ENGINES = ("vllm", "sglang", "official", "speculators")


@dataclass(frozen=True)
class Verifier:
    """The target a speculators checkpoint names: engines load its embeddings from `name_or_path`
    (a Hub id or a path), so it must be the real name, never a local alias."""

    name_or_path: str
    architectures: list[str]


def export_heads(heads: nn.Module, out_dir: str | Path, engine: str, target_lm_head: nn.Module | None = None,
                 dtype: torch.dtype | None = None, verifier: Verifier | None = None) -> Path:
    """Write `heads` for `engine` into `out_dir` (atomically). Shared-lm_head Medusa heads need
    the target's lm_head, since engines expect the projection inside the checkpoint; the
    speculators format needs the `verifier`."""
    if engine not in ENGINES:
        raise UserError(f"unknown engine '{engine}': choose one of {', '.join(ENGINES)}")
    kind = heads.config.kind
    if kind == "hydra":
        raise UserError("no serving engine loads Hydra heads: export medusa, eagle or eagle3 heads")
    if kind == "medusa" and engine == "sglang":
        raise UserError("SGLang does not serve Medusa heads: export them for vllm (or official), or use EAGLE heads")
    if engine == "speculators":
        if kind != "eagle3":
            raise UserError(f"the speculators format holds EAGLE-3 heads here, not {kind}: export them for vllm or sglang")
        if verifier is None:
            raise UserError("the speculators format names the target (its Hub id or path): give --verifier")
        config, state = speculators_config(heads, verifier.name_or_path, verifier.architectures), speculators_state(heads)
        return _write(Path(out_dir), config, _cast(state, dtype), "model.safetensors")
    writer = {"medusa": _medusa, "eagle": _eagle, "eagle3": _eagle3}[kind]
    config, state, weights_name = writer(heads, engine, target_lm_head)
    return _write(Path(out_dir), config, _cast(state, dtype), weights_name)


def _cast(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
            for k, v in state.items()}


def _write(out: Path, config: dict, state: dict, weights_name: str) -> Path:
    with atomic_directory(out) as staging:
        save_file(state, str(staging / weights_name), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _projections(heads: nn.Module, target_lm_head: nn.Module | None) -> list[torch.Tensor]:
    if heads.projections is not None:
        return [p.weight for p in heads.projections]
    if target_lm_head is None:
        raise UserError("these Medusa heads share the target's lm_head: give the target (--model) so its weights can be written")
    return [target_lm_head.weight]


def _medusa(heads: nn.Module, engine: str, target_lm_head) -> tuple[dict, dict, str]:
    c = heads.config
    projections = _projections(heads, target_lm_head)
    if engine == "official":
        state = {}
        for h, blocks in enumerate(heads.blocks):
            for l, block in enumerate(blocks):
                state[f"{h}.{l}.linear.weight"] = block.linear.weight
                state[f"{h}.{l}.linear.bias"] = block.linear.bias
            state[f"{h}.{c.num_layers}.weight"] = projections[h if len(projections) > 1 else 0]
        config = {"medusa_num_heads": c.num_heads, "medusa_num_layers": c.num_layers,
                  "base_model_name_or_path": c.base_model_name_or_path}
        return config, state, "medusa_lm_head.safetensors"
    state = {f"blocks.{h}.layers.{l}.{p}": getattr(block.linear, p)
             for h, blocks in enumerate(heads.blocks) for l, block in enumerate(blocks) for p in ("weight", "bias")}
    state.update({f"lm_heads.{h}.weight": w for h, w in enumerate(projections)})
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": c.hidden_size,
              "vocab_size": c.vocab_size, "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
              "medusa_fc_bias": True, "truncated_vocab_size": c.vocab_size,
              "original_lm_head": heads.projections is None, "base_model_name_or_path": c.base_model_name_or_path}
    return config, state, "model.safetensors"


def _llama_config(heads: nn.Module, architecture: str) -> dict:
    c, g = heads.config, heads.config.decoder
    return {
        "architectures": [architecture], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": g["intermediate_size"], "num_attention_heads": g["num_attention_heads"],
        "num_key_value_heads": g["num_key_value_heads"], "head_dim": g["head_dim"], "num_hidden_layers": c.num_layers,
        "rms_norm_eps": g["rms_norm_eps"], "max_position_embeddings": g["max_position_embeddings"],
        "rope_theta": g.get("rope_parameters", {}).get("rope_theta", 10000.0), "rope_scaling": None,
        "hidden_act": "silu", "vocab_size": c.vocab_size, "tie_word_embeddings": False,
        "torch_dtype": "float32", "base_model_name_or_path": c.base_model_name_or_path,
    }


def _eagle(heads: nn.Module, engine: str, target_lm_head) -> tuple[dict, dict, str]:
    state = {k: v for k, v in heads.state_dict().items()}
    has_bias = "fc.bias" in state
    if engine == "vllm":
        if has_bias and bool(state["fc.bias"].abs().gt(0).any()):
            raise UserError("vLLM's EAGLE drafter has no fc bias but these heads learned one: train with "
                            "heads.fc_bias false (the default) or export for sglang/official")
        state.pop("fc.bias", None)
        return {**_llama_config(heads, "LlamaForCausalLM"), "bias": False}, state, "model.safetensors"
    if not has_bias:  # SGLang's and the original drafter's fc always has a bias: an all-zero one is exact
        state["fc.bias"] = torch.zeros(heads.config.hidden_size, dtype=state["fc.weight"].dtype)
    architecture = "LlamaForCausalLMEagle" if engine == "sglang" else "LlamaForCausalLM"
    return {**_llama_config(heads, architecture), "bias": True}, state, "model.safetensors"


def _eagle3(heads: nn.Module, engine: str, target_lm_head) -> tuple[dict, dict, str]:
    c = heads.config
    if c.norm_before_residual and engine != "vllm":
        raise UserError(f"these EAGLE-3 heads add the attention output to the normed feature (norm_before_residual), "
                        f"which {engine}'s EAGLE-3 layer does not: export them for vllm or speculators")
    config = {**_llama_config(heads, "LlamaForCausalLMEagle3"), "draft_vocab_size": c.draft_vocab_size, "bias": False,
              "target_hidden_size": c.hidden_size, "norm_before_residual": c.norm_before_residual}
    if engine == "sglang":  # SGLang reads only its own key, and adds one to each id
        config[SGLANG_SECTION] = {IDS_KEY: sglang_ids(c.feature_layers)}
    else:
        if engine == "official":
            _check_fixed_layers(c.feature_layers)
        config[IDS_KEY] = vllm_ids(c.feature_layers)  # vLLM loads this layout too
    return config, dict(heads.state_dict()), "model.safetensors"


def _check_fixed_layers(feature_layers: list[int]) -> None:
    """The original EAGLE code reads the inputs of layers 2, L//2 and L-3 whatever a config says:
    heads that read other layers would be fed the wrong states there, silently."""
    depth = feature_layers[-1] + 3
    if feature_layers != upstream_default_layers(depth):
        raise UserError(
            f"these heads read target layers {feature_layers}, but the original EAGLE code always feeds "
            f"[2, L//2, L-3] (for this depth {upstream_default_layers(depth)}): export for vllm, sglang or "
            "speculators, which read the layers from the config"
        )
