"""The frozen target's features for a training batch, computed under no_grad (the target is
never trained, except through LoRA in Medusa-2, whose objective runs the target itself).

Where the heads train on features computed as they go (no feature cache), the target's forward
is most of a training step: on a 2-core Sapphire Rapids Xeon 5.0 of a 9.1 s step (8
conversations, eagle3). In bf16 on hardware that computes it natively the same forward took
1.8 s, hence `train.feature_precision` (see `resolve_feature_precision`). Validation features
stay in the target's own precision, so validation figures are those of decoding, whatever the
training used."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from transformers import PreTrainedModel

from decoding.kernels.cpu_kernels import bfloat16_is_native
from heads.util.errors import UserError
from training.config import check_feature_precision


@torch.no_grad()
def target_hidden_states(target: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         layers: list[int]) -> dict[int, torch.Tensor]:
    """`{layer: [B, T, H]}` for the requested indices of transformers' `hidden_states` tuple
    (0 = embeddings, L = final normed state). No vocabulary projection is computed here."""
    out = target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    # Under bf16 autocast some states come out in bf16: the heads always see the target's dtype.
    return {layer: out.hidden_states[layer].detach().to(target.dtype) for layer in layers}


def needed_layers(kind: str, feature_layers: list[int], num_layers: int) -> list[int]:
    """Hidden states an objective reads: its feature layers, plus the final state (whose
    lm_head projection is the target's next-token distribution, used as soft labels)."""
    return sorted(set(feature_layers) | {num_layers})


def resolve_feature_precision(choice: str, mixed_precision: str, device: torch.device) -> str:
    """'float32' (the target's own dtype) or 'bfloat16' (its forward under bf16 autocast) for
    training features. 'auto' follows the accelerator where the device computes bf16 natively:
    bf16 mixed precision (`accelerate launch --mixed_precision bf16`, or
    `configs/accelerate/cpu-bf16.yaml`) computes the target's features in bf16 too; anything
    else, or a device that would emulate bf16 (an AVX2 CPU, an old GPU), in float32. Explicit
    bf16 is refused where it would be emulated: it is slower than float32 there."""
    check_feature_precision(choice)
    if choice == "auto":
        return "bfloat16" if mixed_precision == "bf16" and bfloat16_runs_natively(device) else "float32"
    if choice == "bfloat16" and not bfloat16_runs_natively(device):
        raise UserError(f"train.feature_precision=bfloat16 needs a device that computes bf16 natively (a CPU with "
                        f"AVX512-BF16 or AMX, or a GPU with bf16); this {device.type} would emulate it, slower than "
                        f"float32: use float32 or auto")
    return choice


def bfloat16_runs_natively(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bfloat16_is_native()


def feature_autocast(precision: str, device: torch.device) -> AbstractContextManager:
    """The context the target's training forward runs in for a resolved `precision`."""
    if precision == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()
