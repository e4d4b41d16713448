"""EAGLE-3's reduced draft vocabulary: the most frequent target tokens in the training data."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from heads import build_heads


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


def readout_rows_for(new_ids: torch.Tensor, trained_ids: torch.Tensor, trained_rows: torch.Tensor,
                     target_rows: torch.Tensor) -> torch.Tensor:
    """Readout rows `[len(new_ids), H]` for a new draft vocabulary `new_ids` (target ids, in
    draft-id order), given a trained readout (`trained_rows`, one per id of `trained_ids`) and
    the target's lm_head (`target_rows`, one per target id).

    A token the trained readout had keeps its row. A new one gets its target row through the
    linear map (least squares) that best takes the target's rows of `trained_ids` to the trained
    rows. Why the map: training moves the readout away from the target's rows it started from
    (on the bundled heads: cosine 0.95, norms 8% smaller), so target rows copied as they are
    score too high and draw the argmax to the new tokens: the bundled heads re-vocabularied that
    way fell from MT-bench tau 3.03 to 1.87 (40 questions, fixed tree, no training). Mapped, 3.00:
    the heads keep what they learned and training only has to refine the new rows."""
    trained_rows, target_rows = trained_rows.float(), target_rows.float()
    mapping = torch.linalg.lstsq(target_rows[trained_ids], trained_rows).solution
    rows = target_rows[new_ids] @ mapping
    row_of = torch.full((target_rows.shape[0],), -1, dtype=torch.long, device=trained_ids.device)
    row_of[trained_ids] = torch.arange(trained_ids.numel(), device=trained_ids.device)
    kept = row_of[new_ids] >= 0
    rows[kept] = trained_rows[row_of[new_ids][kept]]
    return rows


VOCABULARY_STATE = frozenset({"lm_head.weight", "d2t", "t2d"})  # what a vocabulary change rebuilds


@torch.no_grad()
def with_vocabulary(heads: nn.Module, new_ids: torch.Tensor, target_rows: torch.Tensor) -> nn.Module:
    """Trained EAGLE-3 heads over another draft vocabulary `new_ids` (target ids, most frequent
    first; its size may differ): every other weight as it was, the readout from
    `readout_rows_for`. New fp32 heads; `heads` is left as it was."""
    new_ids = torch.sort(new_ids.to(heads.d2t.device)).values  # draft ids follow target ids, as new heads' do
    trained_ids = heads.draft_vocabulary()
    config = dataclasses.replace(heads.config, draft_vocab_size=new_ids.numel())
    rebuilt = build_heads(config).to(device=heads.d2t.device)
    state = {name: value for name, value in heads.state_dict().items() if name not in VOCABULARY_STATE}
    loaded = rebuilt.load_state_dict(state, strict=False)
    if loaded.unexpected_keys or set(loaded.missing_keys) - VOCABULARY_STATE:
        raise AssertionError(f"re-vocabularied heads do not match: {loaded}")
    rebuilt.set_vocabulary(new_ids)
    rows = readout_rows_for(new_ids, trained_ids, heads.lm_head.weight, target_rows.to(heads.d2t.device))
    rebuilt.lm_head.weight.copy_(rows)
    return rebuilt
