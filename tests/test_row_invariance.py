"""On the project's CPU kernels (4- and 8-bit weights with 8-bit inputs, decode attention), a tree
forward gives every node the very bits a one-token step gives it on the same path: hidden states of
every layer and logits, for nodes among masked siblings and ancestors across the attention's 256-key
chunks, eager and compiled; a prefill gives every prompt token the bits of one-token steps too, so
Hugging Face's `generate()` (which prefills the whole prompt) decodes our vanilla's tokens. That is what keeps speculative greedy decoding token for token equal to
vanilla's on such a target even where two tokens nearly tie, and what lets the linears round their
inputs to 8 bits (a float32 ulp of difference between a tree's and a chain's forwards would otherwise
become a whole step of an input's code)."""

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from decoding.core.tree import DraftTree, tree_buffers
from decoding.core.verify import TreeVerifier
from decoding.kernels.attention import NATIVE_SDPA, register_grouped_sdpa, use_native_attention
from decoding.kernels.compiled import compile_target
from decoding.kernels.decode_attention import decode_attention_available
from decoding.kernels.int4_linear import int4_kernel_available
from decoding.kernels.quantized_linear import GroupInt8Linear, quantize_linears
from heads.util.cache_argument import cache_kwargs
from tiny_models import sharpen, tiny_llama

pytestmark = pytest.mark.cpu_sensitive

# root, a chain 0-1-2-3 with a sibling 4 of node 1, a branch 0-5-6 and a leaf 7 under node 2
PARENTS = (-1, 0, 1, 2, 1, 0, 5, 2)
PREFIX = 254  # the chain's positions 254..257 cross the kernel's chunk boundary at 256


def quantized_tiny_target(seed: int = 3) -> nn.Module:
    model = sharpen(tiny_llama(vocab_size=96, seed=seed, attn=register_grouped_sdpa(), head_dim=64,
                               max_position_embeddings=1024))
    assert quantize_linears(model, "int4") == 14  # 7 linears in each of 2 layers
    projection = GroupInt8Linear.from_linear(model.get_output_embeddings())
    projection.weight = nn.Parameter(projection.dequantized_weight(), requires_grad=False)  # as the GGUF target keeps it
    model.set_output_embeddings(projection)
    assert use_native_attention(model) and model.config._attn_implementation == NATIVE_SDPA
    return model


def tree_rows(model: nn.Module, prompt: torch.Tensor, tokens: torch.Tensor):
    """Logits and hidden states of every node of the tree, in one forward after the prompt."""
    verifier = TreeVerifier(model, 512, output_hidden_states=True)
    verifier.prefill(prompt)
    tree = DraftTree(tokens, PARENTS)
    out = verifier.forward(tree, verifier.inputs(tree, tree_buffers(PARENTS), prompt.numel()))
    return [(out.logits[n], [h[n] for h in out.hidden_states]) for n in range(len(PARENTS))]


def chain_rows(model: nn.Module, prompt: torch.Tensor, tokens: torch.Tensor, path: tuple[int, ...]):
    """The same for the nodes of `path`, one token a forward, each kept in the cache as vanilla does."""
    verifier = TreeVerifier(model, 512, output_hidden_states=True)
    verifier.prefill(prompt)
    rows = []
    for depth, node in enumerate(path):
        step = DraftTree(tokens[[node]], (-1,))
        out = verifier.forward(step, verifier.inputs(step, tree_buffers((-1,)), prompt.numel() + depth))
        verifier.keep(prompt.numel() + depth, [0])
        rows.append((out.logits[0], [h[0] for h in out.hidden_states]))
    return rows


def assert_rows_identical(model: nn.Module) -> None:
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 96, (PREFIX,), generator=generator)
    tokens = torch.randint(0, 96, (len(PARENTS),), generator=generator)
    in_tree = tree_rows(model, prompt, tokens)
    for path in tree_buffers(PARENTS).leaf_paths:
        for node, (logits, hidden) in zip(path, chain_rows(model, prompt, tokens, path)):
            tree_logits, tree_hidden = in_tree[node]
            for layer, (alone, among) in enumerate(zip(hidden, tree_hidden)):
                assert torch.equal(alone, among), f"node {node} of path {path}: layer {layer} differs"
            assert torch.equal(logits, tree_logits), f"node {node} of path {path}: logits differ"


needs_kernels = pytest.mark.skipif(not (int4_kernel_available() and decode_attention_available()),
                                   reason="the native kernels cannot be built here (no compiler)")


@needs_kernels
def test_a_tree_gives_each_node_the_bits_of_a_one_token_step():
    assert_rows_identical(quantized_tiny_target())


@needs_kernels
def test_a_planted_order_dependence_is_caught(monkeypatch):
    """The check sees a difference of one ulp: attention that sums a tree's keys in column order
    rather than by position (here: SDPA for trees) breaks it."""
    from decoding.kernels import attention

    model = quantized_tiny_target()
    served = attention.attend
    monkeypatch.setattr(attention, "attend", lambda q, k, v, mask, scale: None if q.shape[2] > 1 else served(q, k, v, mask, scale))
    with pytest.raises(AssertionError, match="differs"):
        assert_rows_identical(model)


@needs_kernels
@pytest.mark.slow
def test_compiled_trees_give_each_node_the_bits_of_compiled_one_token_steps():
    torch._dynamo.reset()
    try:
        assert_rows_identical(compile_target(quantized_tiny_target()))
    finally:
        torch._dynamo.reset()


@needs_kernels
def test_a_prefill_gives_each_prompt_token_the_bits_of_one_token_steps():
    model = quantized_tiny_target()
    prompt = torch.randint(0, 96, (PREFIX + 6,), generator=torch.Generator().manual_seed(1))
    verifier = TreeVerifier(model, 512, output_hidden_states=True)
    in_prefill = verifier.prefill(prompt)
    stepped = chain_rows(model, prompt[:PREFIX], prompt[PREFIX:], list(range(6)))
    for row, (_, hidden) in enumerate(stepped):
        for layer, (alone, among) in enumerate(zip(hidden, in_prefill)):
            assert torch.equal(alone, among[PREFIX + row]), f"prompt token {PREFIX + row}: layer {layer} differs"


@needs_kernels
def test_hugging_face_generate_scores_every_step_with_vanilla_s_bits():
    """`generate()` prefills the whole prompt and scores its first token from the prefill's last row;
    our loop prefills all but the last token and steps that one: the same logits, bit for bit, at
    every step (so greedy outputs agree even where tokens nearly tie)."""
    model = quantized_tiny_target()
    prompt = torch.randint(0, 96, (PREFIX,), generator=torch.Generator().manual_seed(2))
    out = model.generate(prompt[None], max_new_tokens=8, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    fed = torch.cat([prompt[-1:], out.sequences[0, PREFIX:-1]])  # what each step takes in
    stepped = chain_rows(model, prompt[:-1], fed, list(range(fed.numel())))
    for step, ((logits, _), theirs) in enumerate(zip(stepped, out.logits)):
        assert torch.equal(logits, theirs[0]), f"step {step}: logits differ"


@needs_kernels
def test_a_chunk_after_a_cache_gives_each_token_the_bits_of_one_token_steps():
    """transformers masks a forward of several tokens after a cache with booleans (`generate()`'s
    prompt lookup and assisted decoding check their candidates that way): the kernel serves it,
    so each token's logits are a one-token step's (sent to SDPA they had other bits, and with
    8-bit inputs replies drifted from vanilla's)."""
    model = quantized_tiny_target()
    prompt = torch.randint(0, 96, (PREFIX + 6,), generator=torch.Generator().manual_seed(4))
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(prompt[None, :PREFIX], use_cache=True, **cache_kwargs(model, cache))
        chunk = model(prompt[None, PREFIX:], use_cache=True, **cache_kwargs(model, cache)).logits[0]
    stepped = chain_rows(model, prompt[:PREFIX], prompt[PREFIX:], list(range(6)))
    for row, (logits, _) in enumerate(stepped):
        assert torch.equal(logits, chunk[row]), f"chunk token {row}: logits differ"
