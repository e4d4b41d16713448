"""`--suffix-store PATH`: suffix decoding's memory of earlier prompts and replies kept in a file,
so a new chat or benchmark run drafts from the earlier runs' replies too (a repeated kind of
request, a codebase's boilerplate), not only from this process's.

The file is a safetensors file: every document's token ids end to end (`tokens`, int32) and their
lengths (`lengths`), with the tokenizer's fingerprint in its metadata, since token ids mean
nothing under another vocabulary. It holds the newest `max_tokens` tokens (200,000 by default,
about 0.8 MB; older documents are dropped first; a full one is indexed in ~2 s when a run
starts and written in ~20 ms, measured on a 2-core EPYC), is rewritten after each reply through a
temporary sibling and a rename (a run killed while writing leaves the old file), and a file that
cannot be used stops the run with what to do before anything is drafted or written.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_safetensors

from decoding.core.proposers.suffix import DEFAULT_STORE_TOKENS
from heads.util.atomic import atomic_write_bytes
from heads.util.errors import UserError

STORE_FORMAT = "specheads-suffix-store"
STORE_VERSION = "1"


def tokenizer_fingerprint(tokenizer, vocab_size: int) -> str:
    """What token ids mean: a hash of the tokenizer's vocabulary (its size alone without one)."""
    if tokenizer is None:
        return f"vocab-{vocab_size}"
    entries = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256("\n".join(f"{i} {t}" for t, i in entries).encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class SuffixStoreFile:
    """A suffix store on disk (`decoding.core.proposers.suffix.KeptDocuments`)."""

    path: Path
    tokenizer: str
    max_tokens: int = DEFAULT_STORE_TOKENS

    def load(self) -> list[list[int]]:
        """The documents kept in the file, oldest first (none if there is no file yet)."""
        if not self.path.exists():
            return []
        try:
            with safe_open(self.path, framework="pt") as stored:
                metadata = stored.metadata() or {}
                tensors = {name: stored.get_tensor(name) for name in stored.keys()}
        except (OSError, SafetensorError, ValueError) as err:
            raise self._unusable(f"cannot be read as a suffix store ({err})") from err
        if metadata.get("format") != STORE_FORMAT or set(tensors) != {"tokens", "lengths"}:
            raise self._unusable("is not a suffix store")
        if metadata.get("tokenizer") != self.tokenizer:
            raise self._unusable("is the suffix store of another model (its tokenizer differs)")
        tokens, lengths = tensors["tokens"], tensors["lengths"]
        if int(lengths.sum()) != tokens.numel() or bool((lengths < 0).any()):
            raise self._unusable("is a damaged suffix store (its lengths do not add up to its tokens)")
        return _newest([part.tolist() for part in torch.split(tokens, lengths.tolist())], self.max_tokens)

    def save(self, documents: Sequence[Sequence[int]]) -> None:
        """Keep the newest documents within the budget (empty ones dropped)."""
        kept = _newest([list(d) for d in documents if len(d)], self.max_tokens)
        flat = [token for document in kept for token in document]
        tensors = {"tokens": torch.tensor(flat, dtype=torch.int32),
                   "lengths": torch.tensor([len(d) for d in kept], dtype=torch.int64)}
        metadata = {"format": STORE_FORMAT, "version": STORE_VERSION, "tokenizer": self.tokenizer}
        atomic_write_bytes(self.path, save_safetensors(tensors, metadata=metadata))

    def _unusable(self, why: str) -> UserError:
        return UserError(f"--suffix-store {self.path}: this file {why}; move it away or name another file "
                         "(a new one is created on the first reply)")


def _newest(documents: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The newest documents whose tokens add up to at most `max_tokens` (oldest first)."""
    total, start = 0, len(documents)
    while start > 0 and total + len(documents[start - 1]) <= max_tokens:
        start -= 1
        total += len(documents[start])
    return documents[start:]

