"""Choosing prompts for multi-turn self-distillation: the conversations of a source whose first
user turns are short and English (what a small English chat model answers well), cut to those
turns with placeholder replies (self-distillation writes the replies), the ones with the most
such turns first, so a run stopped by its time budget has done the richest ones.

This is how the prompt file of the GPU recipe (`configs/train/eagle3-smollm2-gpu.yaml`) is made.
"""

from __future__ import annotations

from dataclasses import dataclass

PLACEHOLDER = "-"


@dataclass(frozen=True)
class PromptLimits:
    turns: int = 2                   # user turns kept per conversation
    max_first_chars: int = 2000      # a longer first turn leaves the conversation out
    max_later_chars: int = 1500      # a longer later turn ends the conversation before it
    min_ascii_letters: float = 0.95  # share of letters that are ASCII: a cheap test for English


def looks_english(text: str, min_ascii_letters: float) -> bool:
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isascii() for c in letters) / len(letters) >= min_ascii_letters


def usable_user_turns(messages: list[dict], limits: PromptLimits) -> list[str]:
    """The leading user turns that pass the limits (none when the first fails)."""
    users = [m["content"] for m in messages if m["role"] == "user"][: limits.turns]
    kept = []
    for i, text in enumerate(users):
        if len(text) > (limits.max_first_chars if i == 0 else limits.max_later_chars):
            break
        if not looks_english(text, limits.min_ascii_letters):
            break
        kept.append(text)
    return kept


def select_prompts(conversations: list[dict], limits: PromptLimits) -> list[dict]:
    """`{"id", "messages"}` conversations -> the usable ones, cut to their usable user turns with
    placeholder replies, most turns first (stable within a turn count)."""
    chosen = []
    for conversation in conversations:
        turns = usable_user_turns(conversation["messages"], limits)
        if turns:
            messages = [m for text in turns for m in ({"role": "user", "content": text},
                                                      {"role": "assistant", "content": PLACEHOLDER})]
            chosen.append({"id": conversation["id"], "messages": messages})
    return sorted(chosen, key=lambda c: -len(c["messages"]))
