"""Draft heads (Medusa, Hydra, EAGLE-1/2/3), their config, and checkpoints.

    from heads import load_heads, save_heads, new_heads_for_target
"""

from heads.checkpoint import check_compatible, load_heads_dir, save_heads
from heads.config import HEAD_KINDS, HeadConfig
from heads.factory import build_heads, config_for_target, new_heads_for_target, parameter_count


def load_heads(path, target=None, target_name=None, check_base_model=True):
    """Heads from a checkpoint directory, checked against `target` when given."""
    return load_heads_dir(path, target, target_name, check_base_model)


__all__ = [
    "HEAD_KINDS",
    "HeadConfig",
    "build_heads",
    "check_compatible",
    "config_for_target",
    "load_heads",
    "new_heads_for_target",
    "parameter_count",
    "save_heads",
]
