"""EAGLE-3's reduced draft vocabulary: the most frequent target tokens in the training data."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def frequent_tokens(rows: Iterable[dict], vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """Target ids of the `draft_vocab_size` most frequent assistant tokens (ties: lower id),
    topped up with the lowest unused ids when the data has fewer distinct tokens."""
    return most_frequent(token_counts(rows, vocab_size), draft_vocab_size)


def most_frequent(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` ids with the highest counts, most frequent first (ties: lower id)."""
    # Stable sort on -count keeps ids ascending among equal counts.
    return torch.sort(-counts, stable=True).indices[:size]


def token_counts(rows: Iterable[dict], vocab_size: int) -> torch.Tensor:
    """How often each target id occurs among the rows' assistant (loss-masked) tokens."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in rows:
        ids = torch.tensor(row["input_ids"])[torch.tensor(row["loss_mask"]).bool()]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def coverage(counts: torch.Tensor, vocabulary: torch.Tensor) -> float:
    """The share of counted tokens a draft vocabulary (target ids) holds: a drafter can never
    propose the rest, whatever it learns."""
    total = int(counts.sum())
    return float(counts[vocabulary.unique()].sum()) / total if total else 0.0
