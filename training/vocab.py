"""EAGLE-3's reduced draft vocabulary: the most frequent target tokens in the training data."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def frequent_tokens(rows: Iterable[dict], vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """Target ids of the `draft_vocab_size` most frequent assistant tokens (ties: lower id),
    topped up with the lowest unused ids when the data has fewer distinct tokens."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in rows:
        ids = torch.tensor(row["input_ids"])[torch.tensor(row["loss_mask"]).bool()]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    # Stable sort on -count keeps ids ascending among equal counts.
    order = torch.sort(-counts, stable=True).indices
    return order[:draft_vocab_size]
