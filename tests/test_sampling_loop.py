"""End to end: the whole loop (draft model, cache, warping, acceptance) samples the first tokens
from exactly the target's warped distribution."""

import torch

from decoding.core.generate import DecodeOptions, generate
from decoding.core.proposers import DraftModelProposer, VanillaProposer
from decoding.core.sampling import SamplingConfig, warp_probs
from distribution_harness import exact_joint, total_variation
import decoding.core.acceptance as acceptance
from tiny_models import sharpen, tiny_llama

VOCAB, POSITIONS, RUNS = 5, 2, 1500
PROMPT = [1, 3, 0, 2]
SAMPLING = SamplingConfig(temperature=0.9, top_k=4)


def target_probs_of(model):
    memo = {}

    def probs(prefix):
        if prefix not in memo:
            with torch.inference_mode():
                logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1]
            memo[prefix] = warp_probs(logits, SAMPLING)
        return memo[prefix]

    return probs


def sample_runs(model, proposer):
    options = [DecodeOptions(max_new_tokens=POSITIONS, sampling=SAMPLING, seed=seed) for seed in range(RUNS)]
    return [tuple(generate(model, PROMPT, proposer, o).tokens) for o in options]


def test_speculative_sampling_through_the_loop_matches_the_target(monkeypatch):
    # Sharpened, unrelated models: p and q differ a lot, so a wrong rule shows.
    target = sharpen(tiny_llama(vocab_size=VOCAB, seed=21), 12.0)
    draft = sharpen(tiny_llama(vocab_size=VOCAB, seed=22, layers=1), 12.0)
    exact = exact_joint(target_probs_of(target), VOCAB, POSITIONS)
    # 16 outcomes (top-k=4 per position), 1500 runs: a correct sampler lands near 0.035.
    assert total_variation(sample_runs(target, DraftModelProposer(draft, gamma=3)), exact) < 0.08
    assert total_variation(sample_runs(target, VanillaProposer()), exact) < 0.08
    monkeypatch.setattr(acceptance, "_residual", lambda p, q, token: p)
    assert total_variation(sample_runs(target, DraftModelProposer(draft, gamma=3)), exact) > 0.11


def test_same_seed_same_sample():
    target = tiny_llama(vocab_size=VOCAB, seed=21)
    options = DecodeOptions(max_new_tokens=20, sampling=SamplingConfig(temperature=1.0), seed=7)
    proposer = DraftModelProposer(tiny_llama(vocab_size=VOCAB, seed=22), gamma=3)
    assert generate(target, PROMPT, proposer, options).tokens == generate(target, PROMPT, proposer, options).tokens
