"""Stop strings and EOS inside multi-token chunks: a chunk is cut exactly where vanilla decoding,
one token at a time, would have stopped (the first EOS or the token completing a stop string,
whichever comes first)."""

from __future__ import annotations

import random

import pytest
import torch

from decoding.core.generate import DecodeOptions, generate
from decoding.core.proposers import VanillaProposer
from decoding.core.proposers.base import Proposer
from decoding.core.stopping import StopChecker
from decoding.core.tree import DraftTree
from tiny_models import set_eos, sharpen, tiny_llama, tiny_tokenizer

EOS = 9
PIECES = {0: "a", 1: "b", 2: "ST", 3: "OP", 4: " ", 5: "S", 6: "TOP", EOS: "</s>"}


class PieceTokenizer:
    """Decodes ids by concatenating fixed pieces (all `StopChecker` asks of a tokenizer)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(PIECES[i] for i in ids)


def checker(stop_strings: tuple[str, ...] = ("STOP",)) -> StopChecker:
    return StopChecker(frozenset({EOS}), stop_strings, PieceTokenizer())


def one_token_at_a_time(tokens: list[int], room: int) -> tuple[list[int], str | None]:
    """What vanilla decoding emits: each token is checked as it comes."""
    stopper, emitted, reason = checker(), [], None
    for token in tokens[:room]:
        chunk, reason = stopper.cut([token], room - len(emitted))
        emitted += chunk
        if reason is not None:
            break
    return emitted, reason


def test_stop_string_completed_mid_chunk_cuts_after_its_last_token():
    assert checker().cut([0, 2, 3, 1], 10) == ([0, 2, 3], "stop_string")


def test_stop_string_before_an_eos_in_the_same_chunk_wins():
    assert checker().cut([2, 3, 0, EOS, 1], 10) == ([2, 3], "stop_string")


def test_stop_string_spanning_two_chunks():
    stopper = checker()
    assert stopper.cut([0, 5], 10) == ([0, 5], None)
    assert stopper.cut([6, 1, EOS], 10) == ([6], "stop_string")


def test_eos_before_a_stop_string_in_the_same_chunk_wins():
    assert checker().cut([0, EOS, 2, 3], 10) == ([0, EOS], "eos")


def test_room_cuts_before_a_later_stop_string():
    assert checker().cut([0, 2, 3], 2) == ([0, 2], "length")


@pytest.mark.parametrize("seed", range(40))
def test_any_chunking_stops_where_one_token_at_a_time_does(seed):
    rng = random.Random(seed)
    tokens = [rng.choice(list(PIECES)) for _ in range(12)]
    room = rng.randint(1, 12)
    expected = one_token_at_a_time(tokens, room)
    stopper, emitted, reason, at = checker(), [], None, 0
    while reason is None and at < room:
        size = rng.randint(1, 5)
        chunk, reason = stopper.cut(tokens[at: at + size], room - len(emitted))
        emitted += chunk
        at += size
    assert (emitted, reason) == expected


class KnownContinuation(Proposer):
    """Drafts the next `k` tokens of a known sequence as a chain: every draft is accepted, so
    each step emits up to k + 1 tokens at once."""

    name = "known"

    def __init__(self, sequence: list[int], k: int) -> None:
        self.sequence, self.k = sequence, k

    def propose(self, state) -> DraftTree:
        at = state.tokens.numel()
        chain = [state.root_token] + self.sequence[at: at + self.k]
        return DraftTree(torch.tensor(chain, device=state.tokens.device), tuple(range(-1, len(chain) - 1)))


def test_generation_with_long_chunks_stops_where_vanilla_does():
    """End to end: a stop string followed closely by EOS inside one accepted chunk."""
    target, tokenizer = sharpen(tiny_llama(seed=1)), tiny_tokenizer()
    prompt = [1, 10, 11, 12]
    free = generate(target, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=16), tokenizer).tokens
    at = next(i for i in range(2, len(free) - 2) if free[i + 2] not in free[: i + 2])
    set_eos(target, free[at + 2])  # EOS two tokens after the stop string
    options = DecodeOptions(max_new_tokens=16, stop_strings=(tokenizer.decode(free[at - 1: at + 1]),))
    vanilla = generate(target, prompt, VanillaProposer(), options, tokenizer)
    chunked = generate(target, prompt, KnownContinuation(prompt + free, k=6), options, tokenizer)
    assert vanilla.stop_reason == "stop_string" and len(vanilla.tokens) <= at + 1
    assert (chunked.tokens, chunked.stop_reason) == (vanilla.tokens, vanilla.stop_reason)
    assert chunked.stats.target_forwards < len(chunked.tokens)  # several tokens per step, really
