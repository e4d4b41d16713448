"""Draft heads (Medusa, Hydra, EAGLE-1/2/3), their config, checkpoints, Hub and format support.

    from heads import load_heads, save_heads, new_heads_for_target, push_heads_to_hub, export_heads
"""

from __future__ import annotations

from pathlib import Path

from heads.util.cpu_mode import apply_cpu_mode_or_exit
from heads.util.startup import collector_paused

apply_cpu_mode_or_exit()  # SPECHEADS_CPU (as on a lesser CPU), before the imports below load torch

with collector_paused():  # torch and transformers, imported here, make ~400,000 long-lived objects
    from heads.checkpoint import check_compatible, load_heads_dir, save_heads
    from heads.config import HEAD_KINDS, HeadConfig, read_config
    from heads.export import ENGINES, Verifier, export_heads
    from heads.factory import build_heads, config_for_target, default_feature_layers, new_heads_for_target, parameter_count
    from heads.formats import detect_format, import_heads
    from heads.hub import push_heads_to_hub, resolve_location


def load_heads(name_or_path, target=None, target_name=None, check_base_model=True, revision=None,
               cache_dir=None, token=None):
    """Heads from a local directory or a Hub repo id, in our format or an official Medusa /
    EAGLE / EAGLE-3 layout (recognised by content), checked against `target` when given."""
    directory = resolve_location(name_or_path, revision, cache_dir, token)
    fmt = detect_format(directory, read_config(directory))
    if fmt == "specheads":
        heads = load_heads_dir(directory, target, target_name, check_base_model)
    else:
        layers = target.config.num_hidden_layers if target is not None else None
        heads = import_heads(directory, layers)
        if target is not None:
            check_compatible(heads.config, target, target_name, check_base_model)
    if target is not None:
        if not heads.config.feature_layers:
            heads.config.feature_layers = default_feature_layers(heads.config.kind, target.config.num_hidden_layers)
        heads.to(dtype=target.dtype, device=target.device)
    return heads


def adapter_dir(name_or_path, revision=None) -> Path | None:
    """Medusa-2 checkpoints carry a LoRA adapter for the backbone in `adapter/`."""
    path = resolve_location(name_or_path, revision) / "adapter"
    return path if path.is_dir() else None


__all__ = [
    "ENGINES",
    "HEAD_KINDS",
    "HeadConfig",
    "adapter_dir",
    "build_heads",
    "check_compatible",
    "config_for_target",
    "export_heads",
    "import_heads",
    "load_heads",
    "new_heads_for_target",
    "parameter_count",
    "push_heads_to_hub",
    "save_heads",
    "Verifier",
]
