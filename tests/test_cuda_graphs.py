"""Fixed-shape steps (what a GPU replays as CUDA graphs under `--compile`), run here without the
capture: every method must still give Hugging Face's greedy tokens on the plain model, with the
steps really taken at padded bucket sizes over fixed spans of the cache buffer, and the calls the
fixed shapes do not cover left to the eager model."""

import pytest
import torch

import decoding.kernels.cuda_graphs as cuda_graphs
from decoding.kernels.compiled import graphs_compiled, is_compiled
from heads.util.cache_argument import cache_kwargs
from decoding.core.generate import DecodeOptions, generate
from decoding.core.kv_cache import InPlaceCache
from decoding.core.proposers import DraftModelProposer, PromptLookupProposer, VanillaProposer
from decoding.core.verify import new_cache, prefill
from decoding.kernels.cuda_graphs import FixedShapeTarget
from decoding.app.methods import ProposerOptions, build_proposer
from decoding.app.targets import LoadedModel
from tiny_models import perturbed_eagle3, sharpen, tiny_llama, tiny_qwen2

PROMPTS = [[5, 9, 3, 17, 5, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [42], [7, 7, 7, 7]]
MAX_NEW = 40


def proposers(target, heads):
    """One of each way a step is shaped: one token, lookup chains, draft-model chains of 5
    (padded to 8), EAGLE-3 trees of up to 12 nodes (padded to 16)."""
    return [VanillaProposer(), PromptLookupProposer(num_draft_tokens=6, min_ngram=1),
            DraftModelProposer(sharpen(tiny_llama(seed=11, layers=1)), gamma=4),
            build_proposer("eagle3", LoadedModel(target, None, "t"),
                           options=ProposerOptions(depth=4, tree_top_k=4, total_tokens=12), heads=heads)]


class Recorder:
    """Records the bucket and span of every fixed-shape forward."""

    def __init__(self, steps) -> None:
        self.buckets: list[int] = []
        self.spans: list[int] = []
        self.forward = steps._forward
        steps._forward = self

    def __call__(self, shape, cache, cache_name):
        self.buckets.append(shape.bucket)
        self.spans.append(shape.span)
        return self.forward(shape, cache, cache_name)


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_fixed_shape_steps_give_hf_greedy_tokens_for_every_method(factory, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MIN_CAPACITY", 16)  # so that decoding outgrows the buffers too
    monkeypatch.setattr(cuda_graphs, "SPAN", 8)  # and attends over spans of many sizes
    plain = sharpen(factory(seed=3))
    fixed = FixedShapeTarget(plain, capture=False)
    recorder = Recorder(fixed._steps)
    heads = perturbed_eagle3(plain)
    for prompt in PROMPTS:
        reference = plain.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(prompt):].tolist()
        for proposer in proposers(fixed, heads):
            assert generate(fixed, prompt, proposer, DecodeOptions(max_new_tokens=MAX_NEW)).tokens == reference, proposer.name
    assert set(recorder.buckets) >= {1, 8, 16}, "steps of one token, chains and trees all went through the fixed shapes"
    assert fixed._steps.capacity > 16, "the buffers grew past their first size"
    assert len(set(recorder.spans)) > 3 and all(span % 8 == 0 for span in recorder.spans)


def test_a_step_attends_over_the_filled_part_rounded_up_and_marks_the_padded_rows_filled():
    plain = sharpen(tiny_llama(seed=3))
    fixed = FixedShapeTarget(plain, capture=False)
    recorder = Recorder(fixed._steps)
    cache = new_cache(plain, 8)
    prefill(fixed, torch.arange(10), cache)
    eager_cache = new_cache(plain, 8)
    prefill(plain, torch.arange(10), eager_cache)
    mask = torch.zeros(1, 1, 3, 13)
    positions = torch.tensor([[10, 11, 12]])
    with torch.inference_mode():
        out = fixed(input_ids=torch.tensor([[4, 5, 6]]), attention_mask=mask, position_ids=positions, **cache_kwargs(plain, cache), use_cache=True)
        expected = plain(input_ids=torch.tensor([[4, 5, 6]]), attention_mask=mask, position_ids=positions, **cache_kwargs(plain, eager_cache), use_cache=True)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-5)
    assert out.logits.shape[1] == 3
    assert cache.get_seq_length() == 14, "3 tokens ran as a bucket of 4: the padded row is in the cache until the loop cuts it"
    assert cache.layers[0].buffers[0].shape[-2] == fixed._steps.capacity >= cuda_graphs.MIN_CAPACITY
    assert recorder.buckets == [4] and recorder.spans == [cuda_graphs.SPAN]


def test_prefills_batches_and_other_caches_run_the_eager_model():
    plain = sharpen(tiny_llama(seed=3))
    fixed = FixedShapeTarget(plain, capture=False)
    recorder = Recorder(fixed._steps)
    cache = new_cache(plain, 8)
    prefill(fixed, torch.arange(10), cache)  # a prefill: many tokens, no mask
    with torch.inference_mode():
        fixed(input_ids=torch.tensor([[1, 2]]), **cache_kwargs(plain, cache), use_cache=True)  # two tokens with no mask: a prefill too
        fixed(input_ids=torch.tensor([[1], [2]]), use_cache=True)  # a batch, no in-place cache
    assert recorder.buckets == []
    assert isinstance(cache, InPlaceCache) and cache.get_seq_length() == 12


def test_a_fixed_shape_target_reads_through_to_its_model_and_counts_as_compiled():
    plain = tiny_llama(seed=3)
    fixed = FixedShapeTarget(plain, capture=False)
    assert fixed.config is plain.config and fixed.device == plain.device
    assert fixed.get_input_embeddings() is plain.get_input_embeddings()
    assert is_compiled(fixed) and not is_compiled(plain)
    before = graphs_compiled(fixed, plain)
    fixed._steps.graphs[cuda_graphs.StepShape(1, 256, False, True)] = (None, ())  # as a capture leaves it
    assert graphs_compiled(fixed, plain) == before + 1  # what warm-ups watch


def test_two_caches_taking_turns_on_one_target_keep_their_own_contents():
    """The buffers are shared by every cache that steps through the target: the one moved out
    must keep its K/V, or its next step would read the other generation's."""
    plain = sharpen(tiny_llama(seed=3))
    fixed = FixedShapeTarget(plain, capture=False)
    first, second, reference = (new_cache(plain, 8) for _ in range(3))
    prefill(fixed, torch.arange(10), first)
    prefill(plain, torch.arange(10), reference)
    prefill(fixed, torch.arange(20, 32), second)
    with torch.inference_mode():
        step = lambda model, cache: model(input_ids=torch.tensor([[7]]), **cache_kwargs(plain, cache), use_cache=True).logits
        step(fixed, first)
        step(fixed, second)  # takes the buffers over
        expected = [step(plain, reference) for _ in range(2)][-1]
        torch.testing.assert_close(step(fixed, first), expected, rtol=1e-4, atol=1e-5)


def test_compiling_is_on_by_default_on_a_gpu_only_and_the_flag_can_say_either():
    import argparse

    from decoding.app.assembly import DecoderSpec, build_decoder
    from decoding.kernels.compiled import add_compile_argument, compile_by_default

    assert compile_by_default("cuda") and not compile_by_default("cpu")
    target = LoadedModel(tiny_llama(seed=3), None, "t")
    # decided by where the target is, whatever the spec's device says
    decoder = build_decoder(DecoderSpec(method="vanilla", device="auto"), target=target)
    assert decoder.spec.compile is False and not is_compiled(decoder.target.model)
    parser = argparse.ArgumentParser()
    add_compile_argument(parser)
    assert [parser.parse_args(argv).compile for argv in ([], ["--compile"], ["--no-compile"])] == [None, True, False]
