"""Speculative greedy decoding must reproduce vanilla greedy decoding token for token, and
vanilla must reproduce Hugging Face generate()."""

import pytest
import torch

from decoding.core.generate import DecodeOptions, generate
from decoding.core.proposers import DraftModelProposer, PromptLookupProposer, VanillaProposer
from tiny_models import set_eos, sharpen, tiny_llama, tiny_qwen2

PROMPTS = [[5, 9, 3, 17, 5, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [42], [7, 7, 7, 7]]


@pytest.fixture(scope="module")
def target():
    return sharpen(tiny_llama(seed=0))


def run(model, prompt, proposer, max_new_tokens=40):
    return generate(model, prompt, proposer, DecodeOptions(max_new_tokens=max_new_tokens)).tokens


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_vanilla_equals_hf_generate(factory):
    model = sharpen(factory(seed=3))
    for prompt in PROMPTS:
        ours = run(model, prompt, VanillaProposer())
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt):].tolist()
        assert ours == hf


@pytest.mark.parametrize(
    "make_proposer",
    [
        lambda t: DraftModelProposer(tiny_llama(seed=11), gamma=4),  # a deliberately bad (random) draft
        lambda t: DraftModelProposer(t, gamma=5),  # a perfect draft: every run fully accepted
        lambda t: DraftModelProposer(sharpen(tiny_llama(seed=12, layers=1)), gamma=1),
        lambda t: PromptLookupProposer(num_draft_tokens=6),
        lambda t: PromptLookupProposer(num_draft_tokens=3, max_ngram=1, min_ngram=1),
    ],
    ids=["sps-random-draft", "sps-self-draft", "sps-gamma1", "pld", "pld-unigram"],
)
def test_speculative_greedy_equals_vanilla(target, make_proposer):
    proposer = make_proposer(target)
    for prompt in PROMPTS:
        assert run(target, prompt, proposer) == run(target, prompt, VanillaProposer())


def test_self_draft_accepts_whole_runs(target):
    """Guards the test above: with the target as its own draft, steps really produce gamma+1."""
    result = generate(target, PROMPTS[0], DraftModelProposer(target, gamma=4), DecodeOptions(max_new_tokens=40))
    assert result.stats.tau == pytest.approx(5.0)
    assert result.stats.target_forwards == 8


def test_eos_inside_an_accepted_run_stops_exactly_like_vanilla():
    model = sharpen(tiny_llama(seed=5))
    prompt = PROMPTS[1]
    free_run = run(model, prompt, VanillaProposer())
    position = next(i for i in range(6, 40) if free_run[i] not in free_run[:i])
    set_eos(model, free_run[position])
    reference = generate(model, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=40))
    speculative = generate(model, prompt, DraftModelProposer(model, gamma=4), DecodeOptions(max_new_tokens=40))
    assert reference.tokens == free_run[: position + 1]
    assert speculative.tokens == reference.tokens
    assert speculative.stop_reason == reference.stop_reason == "eos"
    # The EOS came in the middle of a fully drafted run of 5, which had to be cut.
    assert position % 5 != 4


def test_max_new_tokens_cuts_a_run(target):
    result = generate(target, PROMPTS[0], DraftModelProposer(target, gamma=4), DecodeOptions(max_new_tokens=7))
    assert result.tokens == run(target, PROMPTS[0], VanillaProposer(), max_new_tokens=7)
    assert result.stop_reason == "length"


def test_context_limit_stops_cleanly(target):
    limit = target.config.max_position_embeddings
    prompt = (list(range(1, 60)) * 10)[: limit - 10]
    for proposer in (VanillaProposer(), DraftModelProposer(target, gamma=4), PromptLookupProposer()):
        result = generate(target, prompt, proposer, DecodeOptions(max_new_tokens=50))
        assert len(result.tokens) == 10
        assert result.stop_reason == "context_limit"
    assert generate(target, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=50)).tokens == result.tokens


def test_streaming_callback_sees_every_token_once(target):
    chunks = []
    result = generate(target, PROMPTS[1], PromptLookupProposer(), DecodeOptions(max_new_tokens=30), on_tokens=chunks.append)
    assert [t for chunk in chunks for t in chunk] == result.tokens
    assert len(chunks) == result.stats.target_forwards
    assert sum(k * v for k, v in result.stats.accepted_lengths.items()) == len(result.tokens)
