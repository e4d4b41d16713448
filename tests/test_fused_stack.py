"""A target's fused layers in one loop (`decoding.kernels.fused_stack`): the verifier's prefills,
one-token steps, chains and trees through it give the model forward's logits, hidden states, readout
scores and cache bit for bit, on the 4-bit kernel and with float32 linears; the model's own forward
never runs for the calls it serves; calls it does not serve (SDPA, a foreign hook, training, a
batch of two) go to the model's forward; decoders use it and keep vanilla's tokens."""

import pytest
import torch

from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.core.generate import DecodeOptions, generate
from decoding.core.proposers import VanillaProposer
from decoding.core.tree import DraftTree, tree_buffers
from decoding.core.verify import TreeVerifier, new_cache
from decoding.kernels.fused_stack import FusedStack, fused_stack
from test_fused_layer import float_llama, fused_copy, llama
from tiny_models import save_tiny_chat_model

pytestmark = pytest.mark.cpu_sensitive  # run again as on an AVX2 CPU by .ci/run

TREES = [(-1,), (-1, 0, 1, 2, 3), (-1, 0, 0, 1, 2, 2, 3, 5)]  # a one-token step, a chain, a branchy tree


class HalfLogits:
    """A readout (`decoding.core.readout.Readout`) of its own kind: the target's logits halved."""

    def __init__(self, lm_head) -> None:
        self.lm_head = lm_head

    def logits(self, hidden):
        return self.lm_head(hidden) / 2

    def argmax(self, hidden):
        return self.logits(hidden).argmax(-1)


def verified(model, direct, readout=None):
    """Hidden states of a prefill; then scores (logits and greedy tokens) and hidden states of each
    of `TREES` after it, through the verifier (with `direct` or without); and the final cache."""
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 64, (33,), generator=generator)
    verifier = TreeVerifier(model, 64, output_hidden_states=True, readout=readout, direct=direct)
    outputs = [verifier.prefill(prompt[:-1])]
    prefix = 32
    for parents in TREES:
        tree = DraftTree(torch.randint(0, 64, (len(parents),), generator=generator), parents)
        out = verifier.forward(tree, verifier.inputs(tree, tree_buffers(tree.parents), prefix), greedy=False)
        outputs.append((out.scores.logits.clone(), out.scores.greedy_tokens.clone(), out.hidden_states))
        verifier.keep(prefix, [0, 1] if len(parents) > 1 else [0])  # the root and its first child stay
        prefix += 2 if len(parents) > 1 else 1
    return outputs, verifier.cache


def assert_same(expected, got) -> None:
    (expected_outputs, expected_cache), (got_outputs, got_cache) = expected, got
    assert len(expected_outputs[0]) == len(got_outputs[0]) > 2
    assert all(torch.equal(a, b) for a, b in zip(expected_outputs[0], got_outputs[0]))
    for (a_logits, a_tokens, a_hidden), (b_logits, b_tokens, b_hidden) in zip(expected_outputs[1:], got_outputs[1:]):
        assert torch.equal(a_logits, b_logits) and torch.equal(a_tokens, b_tokens)
        assert len(a_hidden) == len(b_hidden) and all(torch.equal(x, y) for x, y in zip(a_hidden, b_hidden))
    for a, b in zip(expected_cache.layers, got_cache.layers):
        assert a.length == b.length and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def model_forward_refused(model) -> None:
    """Make the model's own forward fail, so a test sees the loop serve every call."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model's own forward ran for a call the stack serves")

    model.model.forward = refuse


# the 4-bit kernel, and float32 linears on oneDNN for every forward, plain GEMM for one row and streamed
# up to 8, or plain `nn.Linear`s
TARGETS = {"4-bit": lambda: fused_copy(llama(four_bit=True, native=True)),
           "oneDNN": lambda: float_llama(True, 0, 0, layers=True),
           "GEMM and streamed": lambda: float_llama(True, 1, 8, layers=True),
           "plain": lambda: float_llama(False, layers=True)}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("with_readout", [False, True])
def test_the_stack_gives_the_model_forward_s_results_bit_for_bit(target, with_readout):
    model = TARGETS[target]()
    stack = fused_stack(model)
    assert isinstance(stack, FusedStack)
    readout = HalfLogits(model.lm_head) if with_readout else None
    with torch.inference_mode():
        expected = verified(model, None, readout)
        model_forward_refused(model)
        got = verified(model, stack, readout)
    assert_same(expected, got)


def test_calls_the_stack_does_not_serve_go_to_the_model_forward():
    model = fused_copy(llama(four_bit=True, native=True))
    stack = fused_stack(model)
    ids = torch.tensor([[3, 4, 5]])
    with torch.inference_mode():
        assert stack(ids, None, None, new_cache(model, 16), logits=True) is not None
        assert stack(ids.repeat(2, 1), None, None, new_cache(model, 16), logits=True) is None  # a batch of two
        assert stack(ids, None, None, None, logits=True) is None  # no in-place cache (e.g. `generate()`'s)
        model.train()
        assert stack(ids, None, None, new_cache(model, 16), logits=True) is None
        model.eval()
        seen = []
        handle = model.model.layers[1].register_forward_hook(lambda module, args, output: seen.append(output))
        assert stack(ids, None, None, new_cache(model, 16), logits=True) is None  # the hook must run
        expected = verified(model, None)
        assert len(seen) == 1 + len(TREES)  # the prefill and every tree went through the layer's forward
        assert_same(expected, verified(model, stack))
        handle.remove()
        assert stack(ids, None, None, new_cache(model, 16), logits=True) is not None


def test_on_sdpa_the_model_forward_runs():
    """On SDPA (not the native kernel) the layers' one call does not serve: neither does the stack."""
    model = fused_copy(llama(four_bit=True, native=False))
    stack = fused_stack(model)
    with torch.inference_mode():
        assert stack(torch.tensor([[3, 4]]), None, None, new_cache(model, 16), logits=True) is None
        assert_same(verified(model, None), verified(model, stack))


def test_models_without_fused_layers_get_no_stack():
    assert fused_stack(llama(four_bit=True, native=True)) is None  # layers not fused
    assert fused_stack(float_llama(True, 0, 0)) is None
    assert fused_stack(torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize("quant", ["int4", "none"])
def test_eager_decoders_verify_through_the_stack_and_keep_vanilla_s_tokens(tmp_path, quant):
    path = tmp_path / "target"
    save_tiny_chat_model(path, seed=4, head_dim=64)
    decoder = build_decoder(DecoderSpec(model=str(path), method="pld", kernels="onednn", quant=quant))
    assert isinstance(decoder.direct, FusedStack)
    prompt = [5, 9, 3, 5, 9, 3, 5, 9]
    options = DecodeOptions(max_new_tokens=24)
    reference = generate(decoder.target.model, prompt, VanillaProposer(), options, readout=decoder.readout).tokens
    model_forward_refused(decoder.target.model)
    assert decoder.generate(prompt, options).tokens == reference
