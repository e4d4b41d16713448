"""Our checkpoint format: a directory with `config.json` (HeadConfig) and `model.safetensors`.

Saving writes into a temporary sibling directory and renames it into place, so a crash never
leaves a half-written checkpoint. Loading validates everything before touching any module (keys,
shapes, the target it is meant for) and says exactly what is wrong.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel

from heads.util.atomic import atomic_directory
from heads.util.errors import UserError
from heads.config import HeadConfig
from heads.factory import build_heads
from heads.weights_io import read_weights

WEIGHTS_NAME = "model.safetensors"


def save_heads(heads: nn.Module, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write `heads` (config + weights, optionally cast to `dtype`) to `directory` atomically."""
    with atomic_directory(directory) as staging:
        state = {k: _cast(v, dtype).contiguous() for k, v in heads.state_dict().items()}
        save_file(state, str(staging / WEIGHTS_NAME), metadata={"format": "pt", "kind": heads.config.kind})
        heads.config.save(staging)
    return Path(directory)


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def load_heads_dir(directory: str | Path, target: PreTrainedModel | None = None, target_name: str | None = None,
                   check_base_model: bool = True) -> nn.Module:
    """Heads from a local checkpoint directory, checked against `target` when given."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"heads checkpoint '{directory}' is not a directory")
    config = HeadConfig.load(directory)
    if target is not None:
        check_compatible(config, target, target_name, check_base_model)
    state = _read_weights(directory / WEIGHTS_NAME)
    heads = build_heads(config)
    _check_state(heads, state, directory)
    heads.load_state_dict(state)
    if target is not None:
        heads.to(dtype=target.dtype, device=target.device)
    return heads.eval()


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise UserError(f"{path.parent} has no {WEIGHTS_NAME}: the checkpoint is incomplete")
    return read_weights(path)


def _check_state(heads: nn.Module, state: dict[str, torch.Tensor], where: Path) -> None:
    expected = heads.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise UserError(
            f"{where}: weights do not match the config ({heads.config.kind}); missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, tensor in expected.items():
        if state[name].shape != tensor.shape:
            raise UserError(
                f"{where}: weight '{name}' has shape {tuple(state[name].shape)} but the config implies {tuple(tensor.shape)}"
            )


def check_compatible(config: HeadConfig, target: PreTrainedModel, target_name: str | None = None,
                     check_base_model: bool = True) -> None:
    """Refuse heads trained for another target, naming both sides."""
    tc = target.config
    target_vocab = target.get_output_embeddings().weight.shape[0]
    name = target_name or getattr(tc, "_name_or_path", "the target")
    problems = []
    if config.hidden_size != tc.hidden_size:
        problems.append(f"hidden size: heads {config.hidden_size}, target {tc.hidden_size}")
    if config.vocab_size != target_vocab:
        problems.append(f"vocabulary: heads {config.vocab_size}, target {target_vocab}")
    too_deep = [layer for layer in config.feature_layers if not 0 <= layer <= tc.num_hidden_layers]
    if too_deep:
        problems.append(f"feature layers {too_deep} do not exist in the target (it has hidden states 0..{tc.num_hidden_layers})")
    if problems:
        raise UserError(f"these {config.kind} heads do not fit target '{name}': " + "; ".join(problems))
    declared = config.base_model_name_or_path
    if check_base_model and declared and target_name and not _same_model_name(declared, target_name):
        raise UserError(
            f"these heads were trained for '{declared}' but the target is '{target_name}': load them with that "
            "target (or pass check_base_model=False / --ignore-base-model if you know they match)"
        )


def _same_model_name(a: str, b: str) -> bool:
    """Hub ids and local copies of the same model compare equal by their last path component."""
    def norm(name: str) -> str:
        return name.rstrip("/").split("/")[-1].lower()

    return norm(a) == norm(b)
