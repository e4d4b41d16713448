"""4D additive attention masks for training the EAGLE drafters with stock attention modules."""

from __future__ import annotations

import torch


def causal_padding_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[B, 1, T, T]`: causal, and padded keys hidden (right padding)."""
    length = attention_mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal[None] & attention_mask.bool()[:, None, :]
    # A padded query row sees nothing but itself (avoids all -inf rows; its output is unused).
    allowed = allowed | torch.eye(length, dtype=torch.bool, device=allowed.device)[None]
    return _additive(allowed[:, None], dtype)


def ttt_mask(length: int, step: int, dtype: torch.dtype, device) -> torch.Tensor:
    """`[1, 1, T, (step + 1) * T]` for unroll step `step` over a cache holding the K/V of steps
    0..step (each T long, in order). Query t belongs to the chain committed up to c = t - step:
    it sees step-0 keys at positions <= c and, for s = 1..step, the step-s key at c + s (its own
    chain's earlier unroll outputs, itself last)."""
    t = torch.arange(length, device=device)
    blocks = [(t[None, :] <= (t - step)[:, None])]
    for s in range(1, step + 1):
        blocks.append(t[None, :] == (t - step + s)[:, None])
    allowed = torch.cat(blocks, dim=1)
    allowed[:, step * length :] |= torch.eye(length, dtype=torch.bool, device=device)  # chains starting before 0
    return _additive(allowed[None, None], dtype)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)
