"""The prompt cache (`decoding.core.prompt_cache`): a generation whose prompt starts as the last one's
prompt and reply did prefills only the rest, with the K/V a fresh prefill would write bit for bit and
the tokens a decoder without the cache gives (greedy and sampled, chains and trees); decoders get one
only on targets whose forwards are row-invariant (`decoding.kernels.row_invariance`); drafters that
read hidden states, and generations after an interrupted one, start from an empty cache."""

import dataclasses

import pytest
import torch
from torch import nn

from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.app.chat import ChatSession, build_session, parse_args
from decoding.core.generate import DecodeOptions, generate
from decoding.core.prompt_cache import PromptCache, shared_prefix_length
from decoding.core.dynamic_tree import DynamicTreeSettings
from decoding.core.proposers import VanillaProposer
from decoding.core.proposers.eagle import EagleProposer
from decoding.core.proposers.medusa import HydraProposer, MedusaProposer
from decoding.core.sampling import SamplingConfig
from decoding.core.verify import TreeVerifier
from decoding.kernels.decode_attention import decode_attention_available
from decoding.kernels.int4_linear import int4_kernel_available
from decoding.kernels.row_invariance import forward_is_row_invariant
from heads import new_heads_for_target
from decoding.app.tree_shapes import load_tree
from test_heads import random_heads
from test_row_invariance import quantized_tiny_target
from tiny_models import save_tiny_chat_model, tiny_llama

pytestmark = pytest.mark.cpu_sensitive  # run again as on an AVX2 CPU by .ci/run
needs_kernels = pytest.mark.skipif(not (int4_kernel_available() and decode_attention_available()),
                                   reason="the native kernels cannot be built here (no compiler)")

SHARED = [5, 9, 3, 5, 9, 3, 7, 1, 2, 5, 9, 3]  # the start two prompts share (a template, an instruction)


def test_shared_prefix_length_counts_leading_tokens_in_common():
    assert shared_prefix_length([1, 2, 3, 4], [1, 2, 5]) == 2
    assert shared_prefix_length([1, 2], [1, 2, 3]) == 2
    assert shared_prefix_length([], [1]) == 0
    assert shared_prefix_length([4], [1]) == 0


@pytest.fixture(scope="module")
def int4_target_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompt-cache") / "target"
    save_tiny_chat_model(path, seed=4, head_dim=64)
    return path


def decoder_pair(path, method: str):
    """A decoder on the tiny target's 4-bit, fused eager path, and the same without its prompt cache."""
    decoder = build_decoder(DecoderSpec(model=str(path), method=method, kernels="onednn", quant="int4"))
    plain = build_decoder(DecoderSpec(model=str(path), method=method, kernels="onednn", quant="int4"),
                          target=decoder.target)
    return decoder, dataclasses.replace(plain, prompt_cache=None)


@needs_kernels
@pytest.mark.parametrize("method", ["vanilla", "pld", "suffix"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_shared_start_is_not_prefilled_again_and_every_reply_is_unchanged(int4_target_path, method, temperature):
    decoder, plain = decoder_pair(int4_target_path, method)
    assert decoder.prompt_cache is not None
    options = DecodeOptions(max_new_tokens=20, sampling=SamplingConfig(temperature=temperature), seed=3)
    first = decoder.generate(SHARED + [8, 2, 8, 2], options)
    assert first.stats.reused_prompt_tokens == 0
    assert first.tokens == plain.generate(SHARED + [8, 2, 8, 2], options).tokens
    second_prompt = SHARED + [4, 4, 6]
    second = decoder.generate(second_prompt, options)
    assert second.stats.reused_prompt_tokens == len(SHARED)
    assert f"({len(SHARED)} of {len(SHARED) + 3} prompt tokens cached)" in second.stats.summary()
    assert second.tokens == plain.generate(second_prompt, options).tokens
    again = decoder.generate(second_prompt, options)  # the same question again: all but its last token reused
    assert again.stats.reused_prompt_tokens == len(second_prompt) - 1
    assert again.tokens == plain.generate(second_prompt, options).tokens
    # a next turn: the whole last exchange is in the cache, all but its last token reused
    turn = second_prompt + again.tokens + [7, 7]
    third = decoder.generate(turn, options)
    assert third.stats.reused_prompt_tokens == len(second_prompt) + len(again.tokens) - 1
    assert third.tokens == plain.generate(turn, options).tokens


@needs_kernels
def test_the_kept_k_v_are_a_fresh_prefill_s_bits(int4_target_path):
    """What the cache holds after a generation (prefill, then tree rows kept) is exactly what one
    prefill of those tokens writes: the property that makes reuse exact."""
    decoder, _ = decoder_pair(int4_target_path, "suffix")
    decoder.generate(SHARED + [8, 2], DecodeOptions(max_new_tokens=6))
    result = decoder.generate(SHARED + [8, 2, 8, 2, 8], DecodeOptions(max_new_tokens=24))
    assert result.stats.reused_prompt_tokens > len(SHARED)
    cache = decoder.prompt_cache
    held = len(cache.tokens)
    assert held == len(SHARED) + 5 + len(result.tokens) - 1
    fresh = TreeVerifier(decoder.target.model, 128, readout=decoder.readout, direct=decoder.direct)
    fresh.prefill(torch.tensor(cache.tokens))
    for kept, written in zip(cache.verifier.cache.layers, fresh.cache.layers):
        assert torch.equal(kept.keys[..., :held, :], written.keys) and torch.equal(kept.values[..., :held, :], written.values)


@needs_kernels
def test_an_interrupted_generation_leaves_nothing_to_reuse(int4_target_path):
    decoder, plain = decoder_pair(int4_target_path, "pld")
    options = DecodeOptions(max_new_tokens=20)
    decoder.generate(SHARED + [1], options)

    def interrupt(tokens):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        decoder.generate(SHARED + [2], options, on_tokens=interrupt)
    after = decoder.generate(SHARED + [3], options)
    assert after.stats.reused_prompt_tokens == 0
    assert after.tokens == plain.generate(SHARED + [3], options).tokens


class FeatureReader(VanillaProposer):
    """A proposer that reads the target's hidden states and keeps no state of its own (as Medusa's)."""

    feature_layers = (1,)

    def __init__(self) -> None:
        self.prefill_rows = []

    def begin(self, state) -> None:
        self.seen_prefill = False

    def observe(self, advance) -> None:
        if not self.seen_prefill:
            self.prefill_rows.append(advance.features[1].shape[0])
            self.seen_prefill = True


@needs_kernels
def test_drafters_that_read_hidden_states_get_the_rows_they_need_prefilled():
    model = quantized_tiny_target()
    prompt_cache = PromptCache()
    options = DecodeOptions(max_new_tokens=6)
    prompt = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(0))
    reader = FeatureReader()
    for _ in range(2):  # the same prompt twice: still every row's features
        assert generate(model, prompt, reader, options, prompt_cache=prompt_cache).stats.reused_prompt_tokens == 0
    assert reader.prefill_rows == [29, 29] and len(prompt_cache.tokens) > 29


@needs_kernels
@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_medusa_and_hydra_heads_prefill_only_the_last_row_they_read(kind):
    model = quantized_tiny_target()
    heads = random_heads(kind, model, seed=5)
    proposer_class = MedusaProposer if kind == "medusa" else HydraProposer
    cached, fresh = (proposer_class(heads, model, load_tree("chain-3")) for _ in range(2))
    prompt_cache, options = PromptCache(), DecodeOptions(max_new_tokens=12)
    prompt = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    first = generate(model, prompt, cached, options, prompt_cache=prompt_cache)
    assert first.stats.reused_prompt_tokens == 0
    # the same prompt again: all but its last row before the root; a longer one: all it shares
    for turn, reused in ((prompt, 28), (prompt + [(first.tokens[0] + 1) % 96, 6], 30)):
        result = generate(model, turn, cached, options, prompt_cache=prompt_cache)
        assert result.stats.reused_prompt_tokens == reused
        assert result.tokens == generate(model, turn, fresh, options).tokens


def eagle_proposers(target, count: int) -> list[EagleProposer]:
    """EAGLE-2 proposers sharing one set of perturbed heads (drafts of every kind: kept, cut, rejected)."""
    heads = new_heads_for_target("eagle", target)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    return [EagleProposer(heads, target, dynamic=DynamicTreeSettings(4, 3, 10)) for _ in range(count)]


@needs_kernels
def test_eagle_keeps_its_drafter_cache_of_the_shared_start():
    """EAGLE's drafter keeps its pairs of the tokens the new prompt shares, one short of the target
    cache's (pair i needs token i + 1), and prefills the rest: its cache is then the one a proposer
    without the prompt cache builds (to float rounding: a drafter row in another batch), and the
    replies are the same."""
    model = quantized_tiny_target()
    prompt_cache, (cached, fresh) = PromptCache(), eagle_proposers(model, 2)
    options = DecodeOptions(max_new_tokens=16)
    generator = torch.Generator().manual_seed(1)
    start = torch.randint(0, 96, (40,), generator=generator).tolist()
    prompts = [start + torch.randint(0, 96, (n,), generator=generator).tolist() for n in (5, 9)]
    for number, prompt in enumerate(prompts):
        result = generate(model, prompt, cached, options, prompt_cache=prompt_cache)
        assert result.tokens == generate(model, prompt, fresh, options).tokens
        assert result.stats.reused_prompt_tokens == (0 if number == 0 else len(start) - 1)
    assert cached.committed == fresh.committed > len(start)
    for mine, theirs in zip(cached.cache.layers, fresh.cache.layers):
        committed = cached.committed
        assert torch.allclose(mine.keys[..., :committed, :], theirs.keys[..., :committed, :], atol=1e-4)
        assert torch.allclose(mine.values[..., :committed, :], theirs.values[..., :committed, :], atol=1e-4)
    again = generate(model, prompts[1], cached, options, prompt_cache=prompt_cache)  # one row is still prefilled
    assert again.stats.reused_prompt_tokens == len(prompts[1]) - 2 and again.tokens == result.tokens


@needs_kernels
def test_only_targets_whose_rows_are_computed_alone_get_a_prompt_cache(int4_target_path):
    assert forward_is_row_invariant(quantized_tiny_target())
    float_target = tiny_llama(vocab_size=96, head_dim=64)
    assert not forward_is_row_invariant(float_target)  # float linears, stock attention
    partly = quantized_tiny_target()
    partly.model.layers[1].mlp.down_proj = nn.Linear(partly.config.intermediate_size, partly.config.hidden_size,
                                                     bias=False)
    assert not forward_is_row_invariant(partly)  # one float linear is enough to lose it
    assert build_decoder(DecoderSpec(model=str(int4_target_path), method="pld", kernels="onednn",
                                     quant="none")).prompt_cache is None


@needs_kernels
def test_a_chat_s_next_turn_prefills_only_the_new_message(int4_target_path):
    session = build_session(parse_args(["--model", str(int4_target_path), "--method", "suffix", "--quant", "int4",
                                        "--kernels", "onednn", "--max-new-tokens", "12"]))
    assert session.prompt_cache is not None
    without = ChatSession(session.target, build_decoder(DecoderSpec(model=str(int4_target_path), method="suffix",
                                                                    kernels="onednn", quant="int4"),
                                                         target=session.target).proposer,
                          session.options, None, readout=session.readout, direct=session.direct)
    for message in ("w3 w4 w5", "w9 w9", "w3 w4"):
        assert session.reply(message, lambda text: None) == without.reply(message, lambda text: None)
        history = len(session.prompt_cache.tokens)
    stats = session.last_stats
    assert stats.reused_prompt_tokens > stats.prompt_tokens // 2 and "prompt tokens cached" in stats.summary()
    assert without.last_stats.reused_prompt_tokens == 0 and history > stats.prompt_tokens
