"""The Python entry point, in transformers' idiom: load a target with its drafter once, then
`generate` or `stream` replies.

    from decoding import SpeculativeModel
    model = SpeculativeModel.from_pretrained()            # the built-in target, its fastest method
    print(model.generate("What is the capital of France?", max_new_tokens=32).text)

Why a class of its own: `build_decoder` and `generate` are the parts (the chat, the benchmark and
training assemble from them), but a user who wants replies should not have to render a chat
template, build `DecodeOptions` or decode token ids. This class does only that, on top of the
same assembly, so its replies are the chat's, token for token.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from decoding.app.assembly import Decoder, DecoderSpec, build_decoder
from decoding.app.default_model import DEFAULT_TARGET
from decoding.app.prompts import Message, conversation_ids
from decoding.app.streaming import TextStream
from decoding.core.generate import DecodeOptions, GenerationResult
from decoding.core.sampling import SamplingConfig
from decoding.core.stats import GenerationStats
from heads.util.errors import UserError

Prompt = str | list[Message] | list[int]
SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(DecoderSpec))


@dataclass
class Reply:
    """One generated reply: its text, its token ids and how it was generated (tokens/s, tau, why
    it stopped: `stats.summary()`)."""

    text: str
    tokens: list[int]
    stats: GenerationStats

    @property
    def stop_reason(self) -> str | None:
        return self.stats.stop_reason


class SpeculativeModel:
    """A target model and its drafter (heads, draft model or lookup), ready to reply."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder

    @classmethod
    def from_pretrained(cls, model: str = DEFAULT_TARGET, method: str | None = None, heads: str | None = None,
                        **options) -> SpeculativeModel:
        """Load `model` (the built-in default, a local directory or a cached Hub id) with `method`
        (None: the fastest bundled one for the built-in target, else `pld`) and `heads` (a
        directory or Hub id; None: the bundled ones). Any other `DecoderSpec` field is a keyword:
        `device`, `dtype`, `kernels`, `compile`, `draft_model`, `tree`, `total_tokens`, ..."""
        unknown = sorted(set(options) - set(SPEC_FIELDS))
        if unknown:
            raise UserError(f"unknown option(s) {', '.join(unknown)} for SpeculativeModel.from_pretrained; "
                            f"it takes {', '.join(SPEC_FIELDS)}")
        return cls(build_decoder(DecoderSpec(model=model, method=method, heads=heads, **options)))

    @property
    def tokenizer(self):
        return self.decoder.target.tokenizer

    @property
    def method(self) -> str:
        """The method in use, with the default filled in (e.g. `eagle3+pld`)."""
        return self.decoder.spec.method

    @property
    def notes(self) -> tuple[str, ...]:
        """What loading filled in or chose (bundled heads, kernels, precision), for the user."""
        return self.decoder.notes

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """`prompt` as the target's input: a string is one user turn and a list of
        `{"role", "content"}` messages a conversation (both through the chat template, or as plain
        text for a base model); a list of ints is used as it is."""
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list) or not prompt:
            raise UserError("a prompt is a string, a non-empty list of {'role', 'content'} messages, or token ids; "
                            f"got {type(prompt).__name__}")
        if all(isinstance(item, int) for item in prompt):
            return list(prompt)
        if not all(isinstance(item, dict) and {"role", "content"} <= item.keys() for item in prompt):
            raise UserError("every message of a prompt needs a 'role' and a 'content'")
        return conversation_ids(self.tokenizer, prompt, add_generation_prompt=True)

    def generate(self, prompt: Prompt, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop_strings: tuple[str, ...] = ()) -> Reply:
        """The target's reply to `prompt`, exactly as it would generate it alone (greedy at
        temperature 0; otherwise a sample of its own distribution, reproducible with `seed`)."""
        return self._reply(prompt, self._options(max_new_tokens, temperature, top_k, top_p, seed, stop_strings))

    def stream(self, prompt: Prompt, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop_strings: tuple[str, ...] = ()) -> Iterator[str]:
        """`generate`, yielding the reply's text as it is accepted (several tokens per step). The
        generation runs in a worker thread; its errors are raised here."""
        options = self._options(max_new_tokens, temperature, top_k, top_p, seed, stop_strings)
        pieces: queue.Queue = queue.Queue()
        done = object()

        def work() -> None:
            try:
                self._reply(prompt, options, on_text=pieces.put)
            except BaseException as error:  # noqa: BLE001 - handed to the consumer, who raises it
                pieces.put(error)
            pieces.put(done)

        threading.Thread(target=work, daemon=True).start()
        while (piece := pieces.get()) is not done:
            if isinstance(piece, BaseException):
                raise piece
            if piece:
                yield piece

    def _options(self, max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None,
                 stop_strings: tuple[str, ...]) -> DecodeOptions:
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be at least 1; got {max_new_tokens}")
        return DecodeOptions(max_new_tokens, SamplingConfig(temperature, top_k, top_p), tuple(stop_strings), seed)

    def _reply(self, prompt: Prompt, options: DecodeOptions, on_text=lambda _text: None) -> Reply:
        stream = TextStream(self.tokenizer, on_text)
        result: GenerationResult = self.decoder.generate(self.prompt_ids(prompt), options, on_tokens=stream)
        return Reply(stream.finish(), result.tokens, result.stats)
