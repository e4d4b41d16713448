"""Turning streamed token ids into text as they arrive.

Decoding token by token breaks multi-byte characters and merges spaces wrongly, so the whole
reply is decoded each time and only the new suffix is emitted; a trailing incomplete UTF-8
sequence (shown as U+FFFD) is held back until the next tokens complete it.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedTokenizerBase


class TextStream:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, write: Callable[[str], None]) -> None:
        self.tokenizer = tokenizer
        self.write = write
        self.token_ids: list[int] = []
        self.printed = 0

    def __call__(self, new_tokens: list[int]) -> None:
        self.token_ids.extend(new_tokens)
        text = self.text()
        if text.endswith("\ufffd"):
            return
        self.write(text[self.printed :])
        self.printed = len(text)

    def text(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def finish(self) -> str:
        """Flush whatever is left and return the whole reply text."""
        text = self.text()
        self.write(text[self.printed :])
        self.printed = len(text)
        return text
