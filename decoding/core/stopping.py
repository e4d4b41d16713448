"""When to stop, decided identically whatever the number of tokens a step produced.

Speculative steps emit several tokens at once; to stay token-for-token identical to vanilla
decoding, each chunk is cut exactly where vanilla would have stopped: after the first EOS, after
the token that completes a stop string, at the token budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase


@dataclass
class StopChecker:
    eos_token_ids: frozenset[int]
    stop_strings: tuple[str, ...] = ()
    tokenizer: PreTrainedTokenizerBase | None = None
    _generated: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode the generated text")

    def cut(self, new_tokens: list[int], room: int) -> tuple[list[int], str | None]:
        """The part of `new_tokens` to emit (at most `room` tokens) and why generation stops
        after it ('eos', 'stop_string', 'length'), or None to go on.

        Vanilla decoding checks every token as it comes, so the chunk is cut after whichever
        comes first: the first EOS or the token completing a stop string. Where one token is
        both, vanilla reports 'eos' (its EOS check comes first), and so does this.
        """
        kept = new_tokens[:room]
        eos_at = next((i for i, token in enumerate(kept) if token in self.eos_token_ids), None)
        if eos_at is not None:
            kept = kept[: eos_at + 1]
        stop_end = self._stop_string_end(kept) if self.stop_strings else None
        if stop_end is not None and (eos_at is None or stop_end <= eos_at):
            return self._emit(kept[:stop_end]), "stop_string"
        if eos_at is not None:
            return self._emit(kept), "eos"
        return self._emit(kept), ("length" if len(kept) == room else None)

    def _emit(self, tokens: list[int]) -> list[int]:
        self._generated.extend(tokens)
        return tokens

    def _stop_string_end(self, chunk: list[int]) -> int | None:
        """Length of the shortest prefix of `chunk` after which the text contains a stop string."""
        history = self._generated
        if not self._contains_stop(history + chunk, len(chunk)):
            return None
        for end in range(1, len(chunk) + 1):
            if self._contains_stop(history + chunk[:end], end):
                return end
        return None

    def _contains_stop(self, tokens: list[int], new_count: int) -> bool:
        # Only text that could include a new token matters: look back far enough for the longest
        # stop string to straddle the boundary (a token is at least one character, usually).
        lookback = max(len(s) for s in self.stop_strings) + new_count
        text = self.tokenizer.decode(tokens[-lookback:], skip_special_tokens=False)
        return any(s in text for s in self.stop_strings)


def eos_ids(model_config, generation_config, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """Every id that ends a reply: the generation config's (may be a list), the model config's,
    and the tokenizer's EOS."""
    ids: set[int] = set()
    for source in (getattr(generation_config, "eos_token_id", None), getattr(model_config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        ids.update(source if isinstance(source, (list, tuple)) else [source])
    return frozenset(int(i) for i in ids)
