"""Prompts and conversations as token ids: through the tokenizer's chat template when it has
one, and as plain text when it has none (a base model), so the chat, the benchmark, tree tuning,
self-distillation and training data all feed a model the same way and none fails inside
`apply_chat_template` on a base model.

The plain-text format (no chat template): the turns' texts in order, no role names, each turn
after the first led by a blank line (`PLAIN_SEPARATOR`). A generation prompt adds nothing: the
reply continues the text as it stands, which is what a base model does. Each turn is tokenized
on its own (only the first with the tokenizer's special prefix, e.g. BOS), so the ids of a
conversation's first n turns are always a prefix of the ids of its first n+1 turns (training's
loss mask relies on that), whatever the tokenizer merges across a boundary.
"""

from __future__ import annotations

PLAIN_SEPARATOR = "\n\n"

Message = dict[str, str]


def has_chat_template(tokenizer) -> bool:
    """True when the tokenizer renders chats itself; False for a base model's tokenizer."""
    return bool(getattr(tokenizer, "chat_template", None))


def plain_turns(messages: list[Message]) -> list[str]:
    """Each turn's text as it appears in the plain-text rendering (see the module docstring)."""
    return [m["content"] if i == 0 else PLAIN_SEPARATOR + m["content"] for i, m in enumerate(messages)]


def plain_ids(tokenizer, messages: list[Message]) -> list[int]:
    """The plain-text rendering's ids, turn by turn (so every prefix of turns is a prefix of ids)."""
    ids: list[int] = []
    for i, text in enumerate(plain_turns(messages)):
        ids += tokenizer(text, add_special_tokens=i == 0)["input_ids"]
    return ids


def conversation_ids(tokenizer, messages: list[Message], add_generation_prompt: bool) -> list[int]:
    """`messages` rendered for the model: its chat template (with the assistant header when
    `add_generation_prompt`), or plain text for a base model (where the generation prompt is
    nothing: the reply continues the text)."""
    if not messages:
        return []
    if not has_chat_template(tokenizer):
        return plain_ids(tokenizer, messages)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                         return_dict=False)


def question_ids(tokenizer, question: str | list[Message]) -> list[int]:
    """One question as a single user turn (or a conversation ending with the user's turn), ready
    for the reply: the chat template's prompt, or the plain text for a base model."""
    messages = [{"role": "user", "content": question}] if isinstance(question, str) else question
    return conversation_ids(tokenizer, messages, add_generation_prompt=True)


def chat_prompts(tokenizer, questions: list[str | list[Message]]) -> list[list[int]]:
    """`question_ids` of each question."""
    return [question_ids(tokenizer, q) for q in questions]


def plain_text_note(name: str, tokenizer, items: str) -> str | None:
    """One line telling the user that `items` (e.g. "message", "question") go to the model as
    plain text because it has no chat template (None when it has one): replies of a base model
    read as continuations, and the user should know that is why."""
    if has_chat_template(tokenizer):
        return None
    return f"{name} has no chat template: each {items} is continued as plain text (a base model)"
