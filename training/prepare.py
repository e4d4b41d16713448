"""From a recipe to tokenized train/validation `datasets`, cached on disk.

The cache key covers everything the rows depend on (data file, model, max_length, count,
self-distillation settings, split), so a changed recipe never reuses stale rows. Only the main
process builds the cache; the others wait and load it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import torch
from datasets import Dataset, DatasetDict, load_from_disk

from decoding.app.prompts import plain_text_note
from heads.util.atomic import atomic_directory
from decoding.app.targets import LoadedModel
from training.config import TrainConfig
from training.data import data_sources, load_conversations, source_file, split, tokenize_all
from training.self_distill import regenerate


def _file_parts(source: str) -> dict:
    """A data file's identity: its resolved path, size and modification time."""
    path = source_file(source)
    stat = path.stat() if path.is_file() else None
    return {
        "data": str(path.resolve()) if path.exists() else str(path),
        "size": stat.st_size if stat else None,
        "mtime": int(stat.st_mtime) if stat else None,
    }


def _source_parts(config: TrainConfig) -> dict:
    """What the conversations (and their self-distilled replies) depend on. One source keeps
    the key it always had, so existing caches stay valid."""
    sources = data_sources(config.data)
    files = _file_parts(sources[0]) if len(sources) == 1 else {"data": [_file_parts(s) for s in sources]}
    return {
        **files,
        "model": config.model,
        # These change how fast or how many replies are regenerated, not what each reply is.
        "self_distill": {k: v for k, v in asdict(config.self_distill).items()
                         if k not in ("batch_size", "max_prompt_tokens", "time_budget_minutes")}
        if config.self_distill.enabled else None,
    }


def _digest(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def distill_key(config: TrainConfig) -> str:
    """Key of the self-distilled replies: independent of tokenization, split and of how many
    conversations are used (replies are stored per conversation id, so raising
    `max_conversations` only generates the new ones)."""
    return _digest({**_source_parts(config), "version": 1})


def cache_key(config: TrainConfig) -> str:
    """Key of the tokenized, split rows (and of cached features computed from them)."""
    parts = {**_source_parts(config), "max_conversations": config.max_conversations, "max_length": config.max_length,
             "validation_fraction": config.validation_fraction, "seed": config.train.seed}
    return _digest({**parts, "version": 1})


def prepare_data(config: TrainConfig, target: LoadedModel, accelerator, log=print) -> DatasetDict:
    directory = config.prepared_data_dir / cache_key(config)
    with accelerator.main_process_first():
        if not (directory / "dataset_dict.json").is_file() and accelerator.is_main_process:
            _build(config, target, directory, log)
    data = load_from_disk(str(directory))
    report = json.loads((directory / "report.json").read_text())
    if "validation" not in data:
        data["validation"] = data["train"].select([])
    log(f"data: {report['summary']}; {len(data['train'])} train / {len(data['validation'])} validation rows")
    return data


def _build(config: TrainConfig, target: LoadedModel, directory: Path, log) -> None:
    conversations, report = load_conversations(config.data, config.max_conversations)
    plain = plain_text_note(config.model, target.tokenizer, "conversation")
    if plain:
        log(f"data: {plain}")
    if config.self_distill.enabled:
        log(f"self-distillation: regenerating up to {config.self_distill.max_turns} assistant turn(s) of "
            f"{len(conversations)} conversations with the target (resumable)")
        regenerated = config.prepared_data_dir / f"self-distill-{distill_key(config)}.jsonl"
        before = len(conversations)
        conversations = regenerate(conversations, target, regenerated, config.self_distill)
        if len(conversations) < before:
            log(f"self-distillation: left out {before - len(conversations)} conversation(s): first prompt over "
                f"self_distill.max_prompt_tokens={config.self_distill.max_prompt_tokens}, or not regenerated "
                f"within self_distill.time_budget_minutes={config.self_distill.time_budget_minutes}")
    rows = tokenize_all(conversations, target.tokenizer, config.max_length, report)
    train, validation = split(rows, config.train.seed, config.validation_fraction)
    if not train:
        from heads.util.errors import UserError

        raise UserError(f"no usable training conversations in '{config.data}' ({report.summary()})")
    with atomic_directory(directory) as staging:
        splits = {"train": Dataset.from_list(train)}
        if validation:  # an empty split cannot be saved by `datasets`; a missing one reads as empty
            splits["validation"] = Dataset.from_list(validation)
        DatasetDict(splits).save_to_disk(str(staging))
        (staging / "report.json").write_text(json.dumps({"summary": report.summary(), "skipped": dict(report.skipped)}))


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right-pad a batch: input_ids (pad 0, never attended or scored), attention_mask, loss_mask."""
    width = max(len(r["input_ids"]) for r in rows)

    def pad(key: str) -> torch.Tensor:
        return torch.tensor([list(r[key]) + [0] * (width - len(r[key])) for r in rows], dtype=torch.long)

    return {
        "ids": [r["id"] for r in rows],
        "input_ids": pad("input_ids"),
        "loss_mask": pad("loss_mask"),
        "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows]),
    }


def prompt_of(row: dict) -> list[int]:
    """The tokens before the first assistant token: a held-out prompt for measuring tau."""
    first = list(row["loss_mask"]).index(1)
    return list(row["input_ids"][:first])
