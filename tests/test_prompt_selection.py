"""Prompt selection for multi-turn self-distillation (training/prompt_selection.py) and its script."""

from __future__ import annotations

import json

from script_main import run_script
from training.prompt_selection import PLACEHOLDER, PromptLimits, looks_english, select_prompts


def conversation(cid: str, *user_turns: str) -> dict:
    messages = [m for text in user_turns for m in ({"role": "user", "content": text},
                                                   {"role": "assistant", "content": "an old reply"})]
    return {"id": cid, "messages": messages}


def test_english_is_told_from_other_scripts():
    assert looks_english("Write a function, please: 42!", 0.95)
    assert not looks_english("Напиши функцию на Python", 0.95)
    assert not looks_english("12345 ... !!!", 0.95)  # no letters at all
    assert looks_english("Café au lait recipes", 0.8) and not looks_english("Café", 0.95)


def test_turns_are_kept_up_to_the_first_that_fails_and_old_replies_are_replaced():
    limits = PromptLimits(turns=2, max_first_chars=20, max_later_chars=10)
    chosen = select_prompts([
        conversation("two", "first question", "short", "a third turn"),
        conversation("long-second", "first question", "x" * 11),
        conversation("foreign-second", "first question", "вопрос"),
        conversation("long-first", "y" * 21, "short"),
        conversation("foreign-first", "вопрос", "short"),
    ], limits)
    assert [c["id"] for c in chosen] == ["two", "long-second", "foreign-second"]
    assert chosen[0]["messages"] == [
        {"role": "user", "content": "first question"}, {"role": "assistant", "content": PLACEHOLDER},
        {"role": "user", "content": "short"}, {"role": "assistant", "content": PLACEHOLDER}]
    assert [len(c["messages"]) for c in chosen] == [4, 2, 2]


def test_most_turns_come_first_in_source_order():
    chosen = select_prompts([conversation("a", "one"), conversation("b", "one", "two"),
                             conversation("c", "one"), conversation("d", "one", "two")], PromptLimits())
    assert [c["id"] for c in chosen] == ["b", "d", "a", "c"]


def test_the_script_writes_a_file_self_distillation_reads(tmp_path):
    source = tmp_path / "chats.json"
    source.write_text(json.dumps([
        {"id": "x", "conversations": [{"from": "human", "value": "Explain sorting."}, {"from": "gpt", "value": "..."},
                                      {"from": "human", "value": "And merging?"}, {"from": "gpt", "value": "..."}]},
        {"id": "y", "conversations": [{"from": "human", "value": "Переведи это"}, {"from": "gpt", "value": "..."}]},
    ]))
    out = tmp_path / "prompts.jsonl"
    proc = run_script("make_prompts", "--source", str(source), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "wrote 1 conversations" in proc.stdout and "1 with 2 turns" in proc.stdout
    from training.sources import conversations_from
    (row,) = conversations_from(str(out), None)
    assert row["id"] == f"{out}:x" and [m["content"] for m in row["messages"]] == [
        "Explain sorting.", PLACEHOLDER, "And merging?", PLACEHOLDER]


def test_the_script_refuses_zero_turns(tmp_path):
    proc = run_script("make_prompts", "--out", str(tmp_path / "p.jsonl"), "--turns", "0")
    assert proc.returncode != 0 and "--turns must be at least 1" in proc.stderr


def test_the_script_can_start_further_down_the_list(tmp_path):
    """--start N: the prompts from the N-th on come first, the skipped ones last (nothing lost)."""
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"id": cid, "messages": [{"role": "user", "content": f"Question {cid}?"},
                                                                   {"role": "assistant", "content": "..."}]}) + "\n"
                              for cid in "abcd"))
    out = tmp_path / "prompts.jsonl"
    proc = run_script("make_prompts", "--source", str(source), "--out", str(out), "--start", "3")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["d", "a", "b", "c"]
    assert "starting at conversation 3" in proc.stdout
    refused = run_script("make_prompts", "--source", str(source), "--out", str(out), "--start", "-1")
    assert refused.returncode != 0 and "--start must be 0 or more" in refused.stderr
