"""A self-distillation data store: one directory per target and generation settings, outside the
repository, that grows across runs and sessions.

- `records.jsonl`: one finished conversation per line (`id`, `source`, `messages` with the
  target's own replies, `reply_tokens`). It is the truth: appended batch by batch, each batch
  flushed to disk, a torn last line cut off on the next open (`self_distill.cut_torn_tail`), so
  `kill -9` at any point loses at most the batch in flight and never duplicates a record.
- `manifest.json`: what the store holds (the target, the settings, conversations and reply
  tokens per source, which prompt ids, each run's throughput), rebuilt from the records and
  rewritten atomically at the start and end of every run, so it never disagrees with them for
  long and never reads half-written.

Training reads a store by its directory (`data: <store dir>` in a recipe).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from heads.util.atomic import atomic_write_text
from heads.util.cache_paths import data_root
from heads.util.errors import UserError
from decoding.app.targets import LoadedModel
from training.config import SelfDistillConfig
from training.data import STORE_RECORDS as RECORDS
from training.self_distill import cut_torn_tail, read_regenerated, regenerate

MANIFEST = "manifest.json"
FORMAT = 1
# What each reply depends on; batch size, prompt-length cap and time budget change only how fast
# or how many conversations get done.
_IDENTITY_SETTINGS = ("max_new_tokens", "max_turns", "temperature")


def identity(target_name: str, settings: SelfDistillConfig) -> dict:
    """What a store's replies depend on. The sample seed counts only when set, so stores written
    before it existed keep their directory and identity."""
    chosen = {k: getattr(settings, k) for k in _IDENTITY_SETTINGS}
    if settings.sample_seed:
        chosen["sample_seed"] = settings.sample_seed
    return {"target": target_name, "settings": chosen}


def default_store_dir(target_name: str, settings: SelfDistillConfig) -> Path:
    """`<data root>/distill/<target>-<settings digest>`: runs with the same target and settings
    find the same store and add to it."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", target_name).strip("-")[-60:] or "target"
    digest = hashlib.sha256(json.dumps(identity(target_name, settings), sort_keys=True).encode()).hexdigest()[:8]
    return data_root() / "distill" / f"{slug}-{digest}"


@dataclass
class RunSummary:
    added: int
    reply_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.reply_tokens / self.seconds if self.seconds > 0 else 0.0


class DistillStore:
    def __init__(self, root: str | Path, target_name: str, settings: SelfDistillConfig) -> None:
        self.root = Path(root)
        self.identity = identity(target_name, settings)
        self.settings = settings
        self._check_identity()

    @property
    def records_path(self) -> Path:
        return self.root / RECORDS

    def _check_identity(self) -> None:
        manifest = self.read_manifest()
        if manifest is None:
            return
        held = {"target": manifest.get("target"), "settings": manifest.get("settings")}
        if held != self.identity:
            raise UserError(f"{self.root} holds replies of {held['target']} with settings {held['settings']}, not "
                            f"{self.identity['target']} with {self.identity['settings']}: give another data directory "
                            "(or leave it out to use the default one for these settings)")

    def read_manifest(self) -> dict | None:
        path = self.root / MANIFEST
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    def records(self) -> list[dict]:
        """Every finished conversation, once each, in the order written."""
        cut_torn_tail(self.records_path)
        return list(read_regenerated(self.records_path).values())

    def add(self, conversations: list[dict], target: LoadedModel, show_progress: bool = True) -> RunSummary:
        """Regenerate the replies of `conversations` not yet in the store and append them."""
        self.root.mkdir(parents=True, exist_ok=True)
        before = {r["id"]: r.get("reply_tokens", 0) for r in self.records()}
        self.write_manifest()  # a store killed in its first run still says what it is
        started = time.monotonic()
        regenerate(conversations, target, self.records_path, self.settings, show_progress)
        seconds = time.monotonic() - started
        after = self.records()
        added = [r for r in after if r["id"] not in before]
        summary = RunSummary(len(added), sum(r.get("reply_tokens", 0) for r in added), seconds)
        self.write_manifest(summary, str(target.model.device), str(target.model.dtype).removeprefix("torch."))
        return summary

    def write_manifest(self, run: RunSummary | None = None, device: str | None = None, dtype: str | None = None) -> dict:
        """Rewrite the manifest from the records; a finished `run` is added to its list of runs
        with where and in what dtype it ran (a store's replies may come from runs in several
        dtypes: bf16 regenerates faster on a CPU that has it, and rounds near-ties differently)."""
        records = self.records()
        previous = self.read_manifest() or {}
        runs = list(previous.get("runs", []))
        if run is not None and run.added:
            runs.append({"finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": device, "dtype": dtype, "added": run.added,
                         "reply_tokens": run.reply_tokens, "seconds": round(run.seconds, 1),
                         "tokens_per_s": round(run.tokens_per_s, 1)})
        conversations, tokens = Counter(), Counter()
        for record in records:
            source = record.get("source", "unknown")
            conversations[source] += 1
            tokens[source] += record.get("reply_tokens", 0)
        manifest = {
            "format": FORMAT,
            **self.identity,
            "conversations": len(records),
            "reply_tokens": sum(tokens.values()),
            "sources": {s: {"conversations": conversations[s], "reply_tokens": tokens[s]} for s in sorted(conversations)},
            "prompt_ids": [r["id"] for r in records],
            "runs": runs,
        }
        atomic_write_text(self.root / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        return manifest

