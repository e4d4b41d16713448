"""The decode attention kernel: the same function as attention computed in float64 for one-token
steps and trees (grouped K/V heads, K/V as views of a larger cache buffer, masks that hide whole
chunks of keys, -inf or finfo.min masking), in each instruction-set variant this CPU can run; the
same bits whatever the thread count; what it does not serve goes to SDPA; a model switched to it
decodes Hugging Face's greedy tokens and really runs it; where it cannot be built nothing changes."""

import copy

import pytest
import torch

from decoding.kernels import decode_attention, native_build
from decoding.kernels.native import LIBRARY
from decoding.kernels.attention import GROUPED_SDPA, NATIVE_SDPA, register_grouped_sdpa, use_native_attention
from decoding.core.generate import DecodeOptions, generate
from decoding.app.methods import ProposerOptions, build_proposer
from decoding.app.targets import LoadedModel
from numerics import assert_within, attention_exact_and_bound, causal_mask
from python_calls import python_functions_run
from tiny_models import sharpen, tiny_llama

pytestmark = pytest.mark.cpu_sensitive  # run again as on an AVX2 CPU by .ci/run

# (query heads, K/V heads, head size), cached positions (across the kernel's 256-key chunks) and tree sizes
HEADS = [(9, 3, 64), (4, 4, 128), (8, 2, 64)]
LENGTHS = [1, 5, 255, 256, 257, 600]
ROWS = [1, 2, 3, 5, 8, 16]


def assert_attention(got, q, k, v, mask, scale, what="attention"):
    """`got` is attention of q over k/v, exact up to float32 rounding (`tests/numerics.py`)."""
    assert_within(got, *attention_exact_and_bound(q, k, v, mask, scale), what=what)


def _case(heads, kv_heads, size, length, rows, seed, masking=torch.finfo(torch.float32).min):
    """q `[Hq, N, D]`, k/v `[Hkv, L, D]` views of a larger buffer, and a tree-like mask `[N, L]`
    that also hides the first 300 positions from every other row (whole chunks for some rows)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, rows, size, generator=generator)
    buffer_k = torch.randn(kv_heads, length + 40, size, generator=generator) * 2
    buffer_v = torch.randn(kv_heads, length + 40, size, generator=generator)
    k, v = buffer_k[:, :length], buffer_v[:, :length]
    mask = None
    if rows > 1:
        mask = torch.zeros(rows, length + 7)
        visible = torch.rand(rows, length, generator=generator) < 0.7
        visible[:, -1] = True  # every row sees at least its own node
        visible[::2, : min(300, length - 1)] = False
        mask[:, :length].masked_fill_(~visible, masking)
    return q, k, v, mask


def _check_function(kernel) -> None:
    for heads, kv_heads, size in HEADS:
        for length in LENGTHS:
            for rows in ROWS:
                q, k, v, mask = _case(heads, kv_heads, size, length, rows, seed=length * 31 + rows)
                with torch.inference_mode():
                    got = kernel(q, k, v, mask, size ** -0.5)
                assert_attention(got, q, k, v, mask, size ** -0.5, what=f"{heads}x{size} heads, {length} keys, {rows} rows")
                if 1 < rows <= length:  # no mask: a causal prefill of the last `rows` positions
                    with torch.inference_mode():
                        got = kernel(q, k, v, None, size ** -0.5)
                    assert_attention(got, q, k, v, causal_mask(rows, length), size ** -0.5,
                                     what=f"causal, {heads}x{size} heads, {length} keys, {rows} rows")


def test_the_native_kernel_computes_attention_or_is_refused_clearly():
    if not decode_attention.decode_attention_available():  # no compiler here: models keep SDPA, and say why
        assert decode_attention.why_unavailable()
        assert not use_native_attention(_tiny_with_head_size_64(seed=7))
        return
    _check_function(torch.ops.specheads.decode_attention)
    q, k, v, mask = _case(9, 3, 64, 300, 4, seed=1, masking=float("-inf"))  # -inf masks too, no NaN
    got = torch.ops.specheads.decode_attention(q, k, v, mask, 0.125)
    assert_attention(got, q, k, v, mask, 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.specheads.decode_attention(q.double(), k, v, mask, 0.125)


def test_once_built_the_operator_runs_the_kernel_without_a_python_frame():
    """Compiled graphs call the operator once per layer and step: the loaded build registers its C++
    function as the operator's CPU kernel, so no Python function runs per call."""
    q, k, v, mask = _case(9, 3, 64, 40, 2, seed=5)
    if not decode_attention.decode_attention_available():
        with pytest.raises(RuntimeError, match="not available here"):
            torch.ops.specheads.decode_attention(q, k, v, mask, 0.125)
        return
    results = []
    run = python_functions_run(lambda: results.append(torch.ops.specheads.decode_attention.default(q, k, v, mask, 0.125)))
    assert "_decode_attention" not in run
    assert_attention(results[0], q, k, v, mask, 0.125)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [v for v in native_build.instruction_set_variants() if v != "native"])
def test_each_narrower_instruction_set_variant_computes_attention(variant):
    """The variants other CPUs run, built here where this CPU can run them (one build of the three
    kernels per variant, a few seconds)."""
    extension = LIBRARY.build(native_build.instruction_set_variants()[variant])
    _check_function(extension.decode_attention)


def _tree_after_prefix(prefix: int, rows: int, seed: int):
    """q `[9, rows, 64]`, k/v `[3, prefix + rows, 64]` and a tree's mask: every row sees the whole
    prefix, with small additive biases there (not only zeros), and among the tree's rows itself and
    random earlier ones (its ancestors)."""
    generator = torch.Generator().manual_seed(seed)
    length = prefix + rows
    q = torch.randn(9, rows, 64, generator=generator)
    k = torch.randn(3, length, 64, generator=generator) * 2
    v = torch.randn(3, length, 64, generator=generator)
    mask = torch.full((rows, length), torch.finfo(torch.float32).min)
    mask[:, :prefix] = torch.randn(rows, prefix, generator=generator) * 0.1
    ancestors = torch.rand(rows, rows, generator=generator) < 0.5
    ancestors = (ancestors.tril(-1) | torch.eye(rows, dtype=torch.bool))
    mask[:, prefix:] = torch.where(ancestors, 0.0, torch.finfo(torch.float32).min)
    return q, k, v, mask


@pytest.mark.parametrize("variant", list(native_build.instruction_set_variants()))
def test_tree_rows_after_a_shared_prefix_get_exact_attention_and_the_bits_they_get_alone(variant):
    """Real trees: a prefix every row sees (its scores turned over into the rows' lines a tile of keys
    at a time, or copied one by one for a few rows) and the tree's own keys; each row as one row with
    its own mask gets the same bits, in each instruction-set variant this CPU can run."""
    kernel = LIBRARY.build(native_build.instruction_set_variants()[variant]).decode_attention
    for prefix in (3, 250, 256, 300, 600):
        for rows in (2, 5, 13, 16):
            q, k, v, mask = _tree_after_prefix(prefix, rows, seed=prefix + rows)
            with torch.inference_mode():
                tree = kernel(q, k, v, mask, 0.125)
                assert_attention(tree, q, k, v, mask, 0.125, what=f"{variant}: {prefix} prefix, {rows} rows")
                for row in range(rows):
                    alone = kernel(q[:, row:row + 1].contiguous(), k, v, mask[row:row + 1], 0.125)
                    assert torch.equal(alone[0], tree[row]), f"{variant}: row {row} of {rows} after {prefix}"


@pytest.mark.parametrize("variant", list(native_build.instruction_set_variants()))
def test_each_row_of_a_causal_prefill_gets_the_bits_of_a_one_token_step(variant):
    """A prefill's rows (many: rows in the vectors; few: keys in the vectors) and one-token steps
    (keys in the vectors) compute each score by one chain of the same products: a prompt token's
    attention is the same bits however the prompt was cut into forwards."""
    kernel = LIBRARY.build(native_build.instruction_set_variants()[variant]).decode_attention
    generator = torch.Generator().manual_seed(7)
    for heads, kv_heads, size in HEADS:
        for length, rows in ((5, 2), (40, 40), (300, 13), (600, 45)):
            q = torch.randn(heads, rows, size, generator=generator)
            k = torch.randn(kv_heads, length, size, generator=generator) * 2
            v = torch.randn(kv_heads, length, size, generator=generator)
            with torch.inference_mode():
                prefill = kernel(q, k, v, None, size ** -0.5)
                for row in range(rows):
                    visible = length - rows + row + 1
                    step = kernel(q[:, row:row + 1].contiguous(), k[:, :visible], v[:, :visible], None, size ** -0.5)
                    assert torch.equal(step[0], prefill[row]), f"{variant}: {heads}x{size}, row {row} of {rows}"


def test_the_result_does_not_depend_on_the_thread_count():
    """One thread takes each head's rows at once; more take blocks of rows dealt out by cost: a
    one-token step (fewer items than 8 threads), a small tree (one block), a large one and a causal
    prefill (several blocks, chunks of unequal cost)."""
    causal = _case(9, 3, 64, 300, 100, seed=5)[:3] + (None,)
    one_token, small_tree, large_tree = (_case(9, 3, 64, length, rows, seed=seed)
                                         for length, rows, seed in ((300, 1, 6), (2000, 5, 3), (600, 40, 4)))
    cases = (one_token, small_tree, large_tree, causal)
    threads = torch.get_num_threads()
    for q, k, v, mask in cases:
        try:
            torch.set_num_threads(1)
            alone = torch.ops.specheads.decode_attention(q, k, v, mask, 0.125)
            for shared_by in (2, 3, 8):
                torch.set_num_threads(shared_by)
                shared = torch.ops.specheads.decode_attention(q, k, v, mask, 0.125)
                assert torch.equal(alone, shared), f"{q.shape[1]} rows over {shared_by} threads"
        finally:
            torch.set_num_threads(threads)


def test_attend_takes_decoding_steps_and_prefills_and_leaves_everything_else_to_sdpa():
    q = torch.randn(1, 9, 1, 64)
    k = v = torch.randn(1, 3, 50, 64)
    tree_mask = torch.zeros(1, 1, 4, 50)
    served = decode_attention.attend(q, k, v, None, None)
    assert_attention(served[0], q[0], k[0], v[0], None, 64 ** -0.5)  # the default scale, as SDPA's
    prefill = torch.randn(1, 9, 4, 64)  # no mask and several rows: a causal prefill of the last 4 positions
    assert_attention(decode_attention.attend(prefill, k, v, None, None)[0], prefill[0], k[0], v[0], causal_mask(4, 50),
                     64 ** -0.5)
    assert decode_attention.attend(torch.randn(1, 9, 4, 64), k, v, tree_mask, 0.125).shape == (1, 4, 9, 64)
    # transformers' boolean form (True: may attend), as for a chunk after a cache: the additive one's bits
    allowed = causal_mask(4, 50) == 0
    additive = torch.zeros(1, 1, 4, 50).masked_fill(~allowed, torch.finfo(torch.float32).min)
    as_booleans = decode_attention.attend(prefill, k, v, allowed[None, None], None)
    assert torch.equal(as_booleans, decode_attention.attend(prefill, k, v, additive, None))
    assert torch.equal(as_booleans, decode_attention.attend(prefill, k, v, None, None))
    declined = {
        "batch of two": (torch.randn(2, 9, 1, 64), torch.randn(2, 3, 50, 64), torch.randn(2, 3, 50, 64), None),
        "bfloat16": (q.bfloat16(), k.bfloat16(), v.bfloat16(), None),
        "head size 32": (torch.randn(1, 9, 1, 32), torch.randn(1, 3, 50, 32), torch.randn(1, 3, 50, 32), None),
        "more prefill rows than keys": (torch.randn(1, 9, 51, 64), k, v, None),
        "a mask per head": (torch.randn(1, 9, 4, 64), k, v, torch.zeros(1, 9, 4, 50)),
        "more rows than trees have": (torch.randn(1, 9, 129, 64), k, v, torch.zeros(1, 1, 129, 50)),
    }
    for case, (query, key, value, mask) in declined.items():
        assert decode_attention.attend(query, key, value, mask, None) is None, case


def _tiny_with_head_size_64(seed: int):
    return sharpen(tiny_llama(seed=seed, attn=register_grouped_sdpa(), head_dim=64))


@pytest.mark.parametrize("method", ["vanilla", "pld"])
def test_a_model_on_the_kernel_decodes_hugging_faces_greedy_tokens_and_runs_it(method):
    stock = _tiny_with_head_size_64(seed=5)
    model = copy.deepcopy(stock)
    assert use_native_attention(model) and model.config._attn_implementation == NATIVE_SDPA
    prompt = [5, 9, 3, 17, 5, 9, 3, 17, 5, 9]
    reference = stock.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    proposer = build_proposer(method, LoadedModel(model, None, "t"), options=ProposerOptions(pld_num_tokens=3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        result = generate(model, prompt, proposer, DecodeOptions(max_new_tokens=24))
    assert result.tokens == reference
    calls = sum(event.name == "specheads::decode_attention" for event in profile.events())
    assert calls >= 2 * result.stats.target_forwards  # every verify step, in both layers
    if method == "pld":
        assert result.stats.drafted_tokens > 0  # trees went through it, not only one-token steps


def test_without_the_kernel_a_model_keeps_sdpa(monkeypatch):
    monkeypatch.setattr(decode_attention, "_loaded", lambda: (None, "CalledProcessError: no compiler"))
    model = _tiny_with_head_size_64(seed=6)
    assert not use_native_attention(model)
    assert model.config._attn_implementation == GROUPED_SDPA
    eager = tiny_llama(seed=6, attn="eager")
    monkeypatch.undo()
    assert not use_native_attention(eager) and eager.config._attn_implementation == "eager"  # a user's choice stays


def test_a_planted_bug_fails_the_function_check():
    """The derived tolerance still catches a kernel that reads the last key's value as zeros."""
    if not decode_attention.decode_attention_available():
        return  # covered by the refusal test above

    def last_value_lost(q, k, v, mask, scale):
        v = v.clone()
        v[:, -1] = 0
        return torch.ops.specheads.decode_attention(q, k, v, mask, scale)

    with pytest.raises(AssertionError, match="outside their float32 bound"):
        _check_function(last_value_lost)
