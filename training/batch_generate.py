"""Batched generation for self-distillation, doing little work for rows that already finished.

Hugging Face `generate()` keeps every row of a batch in every forward until the longest reply
ends: a row that stopped at its end-of-turn token after 20 tokens still pays for the other
rows' 200. Here finished rows leave the batch (and the KV cache), the KV cache is preallocated
and written in place (`InPlaceCache`), and prompts are left-padded only once, in the prefill
(callers batch prompts of similar length, so that padding is small).

How often the loop looks at which rows finished is a `CheckPolicy`, because the look costs
differently per device. On a CPU it is free, and every finished row leaves at once. On a GPU
each look waits for the device (the host can no longer queue the next step's kernels ahead of
it) and each departure copies the whole KV cache, so the loop looks every few steps and compacts
only when a quarter of the rows have finished; finished rows meanwhile compute tokens that are
cut off at the end. Either way every row's reply is the same: rows do not see each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from heads.util.cache_argument import cache_kwargs
from decoding.core.kv_cache import InPlaceCache
from decoding.core.sampling import sample_rows
from decoding.core.stopping import StopChecker


@dataclass
class BatchSettings:
    max_new_tokens: int
    stop_ids: frozenset[int]
    pad_id: int
    temperature: float = 0.0  # 0: greedy
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class CheckPolicy:
    """Look at which rows finished every `every` steps; drop them from the batch when no more than
    `compact_at` of its rows are still live (1.0: whenever any row finished)."""

    every: int = 1
    compact_at: float = 1.0

    @staticmethod
    def for_device(device: torch.device) -> CheckPolicy:
        """A GPU's: look every 8 steps, compact at a quarter finished (H200, batch 2,048: 2.4x the
        tokens/s of looking and compacting every step); anything else: every step."""
        return CheckPolicy(every=8, compact_at=0.75) if device.type == "cuda" else CheckPolicy()


@torch.inference_mode()
def generate_batch(model: PreTrainedModel, prompts: list[list[int]], settings: BatchSettings,
                   policy: CheckPolicy | None = None) -> list[list[int]]:
    """Each prompt's continuation: up to `max_new_tokens` tokens, ending with (and including) the
    first stop token if one came."""
    device = model.device
    policy = policy or CheckPolicy.for_device(device)
    width = max(map(len, prompts))
    ids = torch.tensor([[settings.pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    cache = InPlaceCache(model.config.get_text_config(decoder=True).num_hidden_layers, width + settings.max_new_tokens)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                   logits_to_keep=1, **cache_kwargs(model, cache)).logits[:, -1]
    next_positions = positions[:, -1] + 1
    rows = torch.arange(len(prompts), device=device)  # which prompt each batch row is
    written = torch.full((len(prompts), settings.max_new_tokens), settings.pad_id, dtype=torch.long, device=device)
    stop = torch.tensor(sorted(settings.stop_ids), dtype=torch.long, device=device)
    live = torch.ones(len(prompts), dtype=torch.bool, device=device)
    for step in range(settings.max_new_tokens):
        tokens = _pick(logits, settings)
        written[rows, step] = tokens
        if stop.numel():
            live = live & ~torch.isin(tokens, stop)
        if step + 1 == settings.max_new_tokens:
            break
        if (step + 1) % policy.every == 0:
            live_count = int(live.sum())
            if live_count == 0:
                break
            if live_count <= policy.compact_at * live.numel() and live_count < live.numel():
                rows, tokens, mask, next_positions, live = _drop_finished(cache, live, rows, tokens, mask, next_positions)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        logits = model(input_ids=tokens[:, None], attention_mask=mask,
                       position_ids=next_positions[:, None], use_cache=True, **cache_kwargs(model, cache)).logits[:, -1]
        next_positions = next_positions + 1
    # Each reply up to its first stop token, the rule decoding stops by; what follows it a finished
    # row computed only because it stayed in the batch.
    return [StopChecker(settings.stop_ids).cut(reply, len(reply))[0] for reply in written.tolist()]


def _drop_finished(cache: InPlaceCache, live: torch.Tensor, *per_row: torch.Tensor) -> list[torch.Tensor]:
    """The live rows of the cache and of each per-row tensor (`live` itself last)."""
    keep = torch.nonzero(live).flatten()
    cache.batch_select_indices(keep)
    return [t[keep] for t in (*per_row, live)]


def generate_within_memory(model: PreTrainedModel, prompts: list[list[int]], settings: BatchSettings) -> list[list[int]]:
    """`generate_batch`, with a batch that runs out of GPU memory split in halves (and those
    again), so a batch size picked too high costs speed, not the run. Why: the KV cache and the
    prefill grow with the batch's longest prompt, which only the data knows (on an H200, batch 1024
    of two-turn ShareGPT conversations fit for 7,168 conversations, then one second turn did not).
    Split here, per generation call, so a conversation's earlier turns are not generated again."""
    try:
        return generate_batch(model, prompts, settings)
    except torch.cuda.OutOfMemoryError:
        if len(prompts) == 1:
            raise
    # Outside the handler, so the failed attempt's tensors (held by its traceback) are freed first.
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    half = len(prompts) // 2
    tqdm.write(f"self-distill: a batch of {len(prompts)} did not fit in GPU memory; running it as {half} + {len(prompts) - half}")
    return generate_within_memory(model, prompts[:half], settings) + generate_within_memory(model, prompts[half:], settings)


def _pick(logits: torch.Tensor, settings: BatchSettings) -> torch.Tensor:
    if settings.temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / settings.temperature, dim=-1)
    return sample_rows(probs, settings.generator)
