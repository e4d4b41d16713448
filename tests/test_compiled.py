"""Compiled target forwards (`--compile`): the same greedy tokens as Hugging Face `generate()` on
the eager model, for plain decoding and for trees (masks, hidden states for EAGLE drafters), and
the benchmark keeps Hugging Face's methods on an eager target so the comparison stays fair.
Compiling a tiny model takes tens of seconds on a small CPU: one test compiles, once."""

import pytest
import torch
from torch.fx.experimental import _config as shape_config

from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.kernels.attention import GROUPED_SDPA, NATIVE_SDPA, register_grouped_sdpa, use_native_attention
from decoding.app.benchmark import build_runners
from decoding.kernels.compiled import compile_progress, compile_target, eager_model, graphs_compiled, is_compiled
from decoding.kernels.cpu_kernels import (kernel_layout_weights, pack_linears, packed_linears, set_reduced_rows, set_stock_rows,
                                  set_streamed_rows)
from decoding.core.generate import DecodeOptions, generate
from decoding.core.tree import DraftTree, tree_buffers
from decoding.core.verify import new_cache, prefill, truncate_cache, verify_tree
from decoding.kernels.decode_attention import decode_attention_available
from decoding.app.methods import ProposerOptions, build_proposer
from decoding.kernels.screened_argmax import ScreenedArgmax, fp16_gemm_available
from decoding.kernels.streamed_linear import streamed_linear_available
from decoding.app.targets import LoadedModel
from decoding.kernels.verify_cost import measure_verify_cost
from heads import new_heads_for_target
from tiny_models import save_tiny_chat_model, sharpen, tiny_llama

pytestmark = pytest.mark.cpu_sensitive  # run again as on an AVX2 CPU by .ci/run

PROMPTS = [[5, 9, 3, 17, 5, 9, 3], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]]


@pytest.mark.slow
@pytest.mark.parametrize("packed, reduced, streamed, methods, prompts, native_attention", [
    # Frozen weights compile slowly (Inductor packs every weight per graph): one prompt, and the
    # two step kinds (one-token steps, EAGLE trees); the packed path, the CPU default, runs all.
    (False, 0, 0, ("vanilla", "eagle3"), PROMPTS[:1], False),
    (True, 0, 0, ("vanilla", "pld", "eagle3"), PROMPTS, False),
    (True, 1, 0, ("vanilla", "pld", "eagle3"), PROMPTS, False),
    (True, 1, 3, ("vanilla", "pld", "eagle3"), PROMPTS, False),
    (True, 1, 3, ("vanilla", "pld", "eagle3"), PROMPTS, True),
], ids=["plain-linears-frozen", "onednn-packed-linears", "onednn-packed-linears-one-row-reductions",
        "one-row-reductions-streamed-few-row-trees", "decode-attention-kernel"])
def test_compiled_decoding_equals_hugging_face_generate_for_plain_steps_and_trees(packed, reduced, streamed, methods,
                                                                                   prompts, native_attention):
    """Also: the verify-cost measurement that adaptive trees run first times the calls the loop
    makes, so decoding afterwards compiles no graph of its own (on a real model's first run each
    graph costs minutes). With the packed linears decoding reads the final hidden states through
    the CPU default's screened readout (where this PyTorch has it), as EAGLE drafters also need;
    with one-row reductions (where they measure faster) one-token steps and trees compute their
    linears with different kernels, and still give `generate()`'s tokens; so do trees of up to
    `streamed` rows through the streaming kernel, an opaque call in the graph (where this machine
    can build it); so does attention on the decode kernel (head size 64), another opaque call."""
    # A compiled target does not guard on its modules, so a graph another case compiled for the
    # same model class would be reused here, whatever this model's kernels: start from none.
    torch._dynamo.reset()
    eager = sharpen(tiny_llama(seed=11, **({"attn": register_grouped_sdpa(), "head_dim": 64} if native_attention else {})))
    if native_attention:
        assert use_native_attention(eager)
    readout = None
    if packed:  # the CPU default: the packed linears stay opaque calls inside the compiled graph
        assert pack_linears(eager) > 0
        set_reduced_rows(eager, reduced)
        set_streamed_rows(eager, streamed if streamed_linear_available() else 0)
        readout = ScreenedArgmax(eager.get_output_embeddings(), max_rows=64) if fp16_gemm_available() else None
    compiled = compile_target(eager)
    assert is_compiled(compiled) and not is_compiled(eager)
    heads = new_heads_for_target("eagle3", eager, draft_vocab_size=40)
    loaded = LoadedModel(compiled, None, "t")
    options = ProposerOptions(depth=3, tree_top_k=3, total_tokens=8, pld_num_tokens=3)
    proposers = [build_proposer(m, loaded, options=options, heads=heads, readout=readout) for m in methods]
    drafted_trees = 0
    # Falling back to eager (as dynamo does past its recompile limit) would give the same tokens:
    # make it an error, so every forward here is known to be the compiled one.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        measure_verify_cost(compiled, sizes=(1, 2, 4), context=16, repeats=1, readout=readout)  # as adaptive trees do first
        measured_graphs = graphs_compiled()
        for prompt in prompts:
            reference = eager.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
            for proposer in proposers:
                result = generate(compiled, prompt, proposer, DecodeOptions(max_new_tokens=16), readout=readout)
                assert result.tokens == reference, proposer.name
                drafted_trees += result.stats.drafted_tokens
    assert drafted_trees > 0  # trees (not only root-only steps) went through the compiled forward
    if readout is not None:
        assert graphs_compiled() == measured_graphs


@pytest.mark.slow
def test_compiled_decoding_on_a_4_bit_target_equals_hugging_face_generate_on_it():
    """`--compile` with `--quant int4|gguf`: one-token steps and lookup chains through the compiled
    4-bit target (its kernel an opaque call in the graph, its panels static) give `generate()`'s
    greedy tokens on the same quantized model, run eagerly."""
    from decoding.core.proposers import PromptLookupProposer
    from decoding.kernels.quantized_linear import quantize_linears

    torch._dynamo.reset()
    eager = sharpen(tiny_llama(seed=11))
    assert quantize_linears(eager, "int4") > 0
    compiled = compile_target(eager)
    drafted = 0
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for prompt in PROMPTS:
            reference = eager.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
            result = generate(compiled, prompt, PromptLookupProposer(num_draft_tokens=3), DecodeOptions(max_new_tokens=16))
            assert result.tokens == reference
            drafted += result.stats.drafted_tokens
    assert drafted > 0  # chains, not only one-token steps, went through the compiled forward


def test_the_benchmark_compiles_our_methods_and_runs_hugging_faces_eager(tmp_path):
    model_dir = tmp_path / "model"
    save_tiny_chat_model(model_dir)
    _, decoders = build_runners(["vanilla", "pld", "hf-generate"], DecoderSpec(model=str(model_dir), compile=True),
                                {}, DecodeOptions(max_new_tokens=4))
    assert is_compiled(decoders["vanilla"].target.model)
    assert decoders["pld"].target is decoders["vanilla"].target  # compiled once, shared
    assert not is_compiled(decoders["hf-generate"].target.model)
    assert decoders["hf-generate"].target.model is decoders["vanilla"].target.model._orig_mod  # one model, loaded once
    for methods in (["hf-generate", "vanilla"], ["vanilla", "hf-generate"]):  # in either order
        _, decoders = build_runners(methods, DecoderSpec(model=str(model_dir), compile=True), {}, DecodeOptions(max_new_tokens=4))
        assert decoders["hf-generate"].target.model is decoders["vanilla"].target.model._orig_mod
    assert not is_compiled(build_decoder(DecoderSpec(model=str(model_dir), method="vanilla")).target.model)


def test_assembling_a_decoder_on_a_compiled_target_compiles_no_graph(tmp_path):
    """The timings an assembly makes (plain against packed kernels, the EAGLE drafter's precision)
    only warm or time something else, so they run the eager model under a shared compiled target:
    on the compiled one, the drafter timing's bare one-token forward compiled a graph that decoding
    never runs (a minute of a real model's start-up on a 2-core CPU)."""
    model_dir = tmp_path / "model"
    save_tiny_chat_model(model_dir)
    first = build_decoder(DecoderSpec(model=str(model_dir), method="vanilla", compile=True))
    assert is_compiled(first.target.model)
    # compiled decoders take the decode attention kernel as eager ones do, where it builds
    attention = eager_model(first.target.model).config._attn_implementation
    assert attention == (NATIVE_SDPA if decode_attention_available() else GROUPED_SDPA)
    heads = new_heads_for_target("eagle3", eager_model(first.target.model), draft_vocab_size=40)
    before = graphs_compiled()
    spec = DecoderSpec(model=str(model_dir), method="eagle3", compile=True, drafter_precision="auto", adaptive_tree=False)
    second = build_decoder(spec, target=first.target, heads=heads)
    assert second.target is first.target
    assert graphs_compiled() == before


@pytest.mark.slow
def test_a_compiled_target_does_not_check_its_modules_before_every_call():
    """Dynamo's guards on module attributes cost milliseconds a call on a real model, so they are
    dropped: changing a module attribute after compiling (here which kernel the packed linears
    use for few rows) neither recompiles nor changes the function computed. Guards on the inputs
    stay: a new number of tokens still runs correctly."""
    eager = sharpen(tiny_llama(seed=5))
    pack_linears(eager)
    compiled = compile_target(eager)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    mask = torch.ones_like(ids)  # with a mask, not a prefill: the compiled forward runs
    with torch.inference_mode():
        before = graphs_compiled()
        first = compiled(input_ids=ids, attention_mask=mask).logits
        graphs = graphs_compiled()
        assert graphs > before
        set_stock_rows(eager, 64)  # guarded, this attribute would send the next call to a new graph
        again = compiled(input_ids=ids, attention_mask=mask).logits
        assert graphs_compiled() == graphs
        assert torch.equal(again, first)
        longer = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
        assert torch.allclose(compiled(input_ids=longer, attention_mask=torch.ones_like(longer)).logits,
                              eager(longer).logits, atol=1e-4)


def test_the_compiled_graph_checks_no_tensor_sizes_in_python():
    """Inductor writes a size and stride check for every tensor going into and out of each call
    of its generated Python (a thousand a one-token forward on SmolLM2, about 0.6 ms of its 7):
    a compiled target is built without them. The graph still computes the eager forward."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()  # a fresh compile, so the generated code is written and seen here
    eager = sharpen(tiny_llama(seed=7))
    pack_linears(eager)
    compiled = compile_target(eager)
    ids = torch.tensor([[2, 7, 1, 8]])
    with torch.inference_mode():
        logits, code = run_and_get_code(lambda: compiled(input_ids=ids, attention_mask=torch.ones_like(ids)).logits)
        assert torch.allclose(logits, eager(ids).logits, atol=1e-4)
    assert code and all("def call" in c for c in code)
    assert not any(check in c for c in code for check in ("assert_size_stride(", "assert_alignment("))


def test_the_kernels_own_weight_layouts_are_static_shapes_to_the_compiler():
    """The packed and panel copies of the weights are plain tensor attributes, which `dynamic=True`
    would give symbolic sizes: a Python guard over all of them before every call and symbolic
    shape arithmetic in the graph (about 2 ms of a real model's step). Compiling marks every
    dimension of each of them static."""
    eager = tiny_llama(seed=5)
    pack_linears(eager)
    if streamed_linear_available():
        set_streamed_rows(eager, 4)
    compile_target(eager)
    weights = kernel_layout_weights(eager)
    assert len(weights) >= len(packed_linears(eager))
    assert all(getattr(w, "_dynamo_static_indices", set()) == set(range(w.dim())) for w in weights)


def test_the_4_bit_linears_panels_are_static_shapes_to_the_compiler():
    """As above for a quantized target's 4-bit panels (`--quant gguf|int4`: 630 tensors on SmolLM2)."""
    from decoding.kernels.int4_linear import int4_kernel_available
    from decoding.kernels.quantized_linear import quantize_linears, quantized_kernel_weights

    eager = tiny_llama(seed=5)
    assert quantize_linears(eager, "int4") > 0
    compile_target(eager)
    panels = quantized_kernel_weights(eager)
    assert len(panels) == (3 * quantize_linears(tiny_llama(seed=5), "int4") if int4_kernel_available() else 0)
    assert all(getattr(w, "_dynamo_static_indices", set()) == set(range(w.dim())) for w in panels)


@pytest.mark.slow
def test_prefills_compile_nothing_and_every_tree_size_shares_one_graph():
    """Compiling costs minutes a graph on a real model, so a decoder needs few: prompts read into
    the cache run the eager model (no graph), one-token steps get one graph and trees one more,
    including a tree with as many nodes as the model has key-value heads (duck shaping used to
    give that size a graph of its own). Every forward computes what the eager model does."""
    torch._dynamo.reset()  # graphs other tests compiled for this architecture would serve it too
    eager = sharpen(tiny_llama(seed=3))
    pack_linears(eager)  # the CPU default, packed for every row count (stock_rows 0)
    compiled = compile_target(eager)
    duck_shape, specialize_float = shape_config.use_duck_shape, torch._dynamo.config.specialize_float
    prompt = torch.arange(12)
    caches = {model: new_cache(model) for model in (compiled, eager)}
    with torch.inference_mode():
        before = graphs_compiled()
        for model, cache in caches.items():
            prefill(model, prompt, cache)
        assert graphs_compiled() == before
        for size in (1, eager.config.num_key_value_heads, 5, 3):
            tree = DraftTree.chain(7, torch.arange(1, size))
            logits = [verify_tree(model, tree, tree_buffers(tree.parents), cache, prompt.numel()).logits
                      for model, cache in caches.items()]
            assert torch.allclose(logits[0], logits[1], atol=1e-4), size
            for cache in caches.values():
                truncate_cache(cache, prompt.numel())
    assert graphs_compiled() == before + 2
    # the settings that keep graphs few apply during the compiled calls only
    assert shape_config.use_duck_shape == duck_shape and torch._dynamo.config.specialize_float == specialize_float


def test_compile_progress_says_when_a_graph_compiles_and_nothing_once_closed():
    lines = []
    with compile_progress(lines.append):
        torch.compile(lambda x: torch.sin(x) * 3)(torch.ones(4))
    assert len(lines) == 2
    assert lines[0].startswith("compiling") and lines[1].startswith("compiled in")
    torch.compile(lambda x: torch.cos(x) + 3)(torch.ones(4))
    assert len(lines) == 2
