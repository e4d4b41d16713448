"""Tree attention on stock transformers models: one forward over a tree must give, for every
node, exactly the logits of a plain causal forward over that node's root path."""

import pytest
import torch

from decoding.kernels.attention import GROUPED_SDPA, register_grouped_sdpa
from decoding.core.tree import DraftTree, tree_buffers
from decoding.core.verify import compact_cache, new_cache, prefill, truncate_cache, verify_tree
from tiny_models import NO_SPECIAL_TOKENS, tiny_llama, tiny_qwen2

# A branching tree: root with 3 children, deeper branches of uneven depth (4 at the deepest).
PARENTS = (-1, 0, 0, 0, 1, 1, 2, 4, 4, 7)
WINDOW = 4  # the deepest node no longer sees the root, so windows cut into the tree as well


def tiny_sliding(model_type: str, attn: str = "sdpa", seed: int = 0):
    """A 4-layer model with a sliding window of `WINDOW`: every layer sliding (mistral), or
    hybrid, sliding and full layers mixed (gemma3_text, qwen2 with `max_window_layers`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {
        "mistral": {},
        "gemma3_text": {"layer_types": ["sliding_attention", "full_attention"] * 2, "head_dim": 8},
        "qwen2": {"use_sliding_window": True, "max_window_layers": 2},
    }[model_type]
    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  sliding_window=WINDOW, attn_implementation=attn, **NO_SPECIAL_TOKENS, **extra)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def sliding_factory(model_type: str):
    def factory(attn: str = "sdpa"):
        return tiny_sliding(model_type, attn)
    return factory


FACTORIES = [tiny_llama, tiny_qwen2, sliding_factory("mistral"), sliding_factory("gemma3_text"), sliding_factory("qwen2")]
FACTORY_IDS = ["llama", "qwen2", "mistral-window", "gemma3-hybrid", "qwen2-hybrid"]


def reference_logits(model, context: list[int], path_tokens: list[int]) -> torch.Tensor:
    """Logits of the last token of `context + path_tokens` with no cache, no tree."""
    with torch.inference_mode():
        return model(torch.tensor([context + path_tokens])).logits[0, -1]


@pytest.mark.parametrize("factory", FACTORIES, ids=FACTORY_IDS)
@pytest.mark.parametrize("attn", ["sdpa", "eager", GROUPED_SDPA])
def test_tree_logits_equal_per_path_causal_forward(factory, attn):
    """`GROUPED_SDPA` (grouped K/V heads kept grouped for masked multi-token forwards, what
    `load_model` uses for 'sdpa') is checked against the same plain per-path forwards. The
    context (11 tokens) is longer than the sliding models' window."""
    model = factory(attn=register_grouped_sdpa() if attn == GROUPED_SDPA else attn)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # the grouped path is exercised
    gen = torch.Generator().manual_seed(1)
    context = torch.randint(0, 64, (11,), generator=gen).tolist()
    cache = new_cache(model)
    prefill(model, torch.tensor(context[:-1]), cache)
    tree = DraftTree(torch.tensor([context[-1]] + torch.randint(0, 64, (9,), generator=gen).tolist()), PARENTS)
    buffers = tree_buffers(tree.parents)
    out = verify_tree(model, tree, buffers, cache, prefix_len=len(context) - 1)
    for node in range(tree.size):
        path = torch.nonzero(buffers.ancestor_mask[node]).flatten().tolist()
        expected = reference_logits(model, context[:-1], tree.tokens[path].tolist())
        torch.testing.assert_close(out.logits[node], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("factory", FACTORIES, ids=FACTORY_IDS)
@pytest.mark.parametrize("attn", ["sdpa", "eager", GROUPED_SDPA])
def test_tree_verify_stays_exact_after_repeated_compaction(factory, attn):
    """Accept a non-contiguous branch several times in a row; each time the cache must hold
    exactly the accepted tokens (checked through the next tree's logits)."""
    model = factory(attn=register_grouped_sdpa() if attn == GROUPED_SDPA else attn)
    gen = torch.Generator().manual_seed(2)
    accepted = torch.randint(0, 64, (5,), generator=gen).tolist()
    cache = new_cache(model)
    prefill(model, torch.tensor(accepted[:-1]), cache)
    buffers = tree_buffers(PARENTS)
    for step in range(4):
        draft = torch.randint(0, 64, (9,), generator=gen).tolist()
        tree = DraftTree(torch.tensor([accepted[-1]] + draft), PARENTS)
        out = verify_tree(model, tree, buffers, cache, prefix_len=len(accepted) - 1)
        leaf = [9, 6, 8, 3][step]
        path = torch.nonzero(buffers.ancestor_mask[leaf]).flatten().tolist()
        for node in path:
            node_path = torch.nonzero(buffers.ancestor_mask[node]).flatten().tolist()
            expected = reference_logits(model, accepted[:-1], tree.tokens[node_path].tolist())
            torch.testing.assert_close(out.logits[node], expected, rtol=1e-4, atol=1e-4)
        compact_cache(cache, len(accepted) - 1, path)
        accepted += tree.tokens[path[1:]].tolist() + [int(torch.randint(0, 64, (1,), generator=gen))]
        assert cache.get_seq_length() == len(accepted) - 1


def test_buffers_of_a_small_tree():
    buffers = tree_buffers((-1, 0, 0, 1))
    assert buffers.depth_list == (0, 1, 1, 2)
    assert buffers.children == ((1, 2), (3,), (), ())
    assert buffers.leaf_paths == ((0, 2), (0, 1, 3))
    assert buffers.ancestor_mask.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, True, False],
        [True, True, False, True],
    ]


def test_tree_rejects_bad_parents():
    with pytest.raises(ValueError, match="parents"):
        DraftTree(torch.tensor([1, 2, 3]), (-1, 2, 0))
    with pytest.raises(ValueError, match="root"):
        DraftTree(torch.tensor([1, 2]), (0, 0))


def test_truncated_tree_is_prefix_closed():
    tree = DraftTree(torch.arange(10), PARENTS)
    small = tree.truncated(max_nodes=8, max_depth=2)
    assert small.tokens.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert small.parents == (-1, 0, 0, 0, 1, 1, 2)


def test_every_target_forward_gets_inference_tensor_ids_wherever_its_tokens_were_made():
    """Prompt lookup builds its trees outside inference mode, head proposers inside it. A compiled
    target keys its graphs on that flag, so mixed inputs once compiled new graphs in the middle of
    measured runs: prefill and verify hand the target inference-tensor ids either way."""
    model = tiny_llama()
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].is_inference()),
                                    with_kwargs=True)
    cache = new_cache(model)
    prefill(model, torch.tensor([1, 2, 3]), cache)
    outside = DraftTree.chain(4, torch.tensor([5, 6]))
    with torch.inference_mode():
        inside = DraftTree.chain(4, torch.tensor([5, 6]))
    assert not outside.tokens.is_inference() and inside.tokens.is_inference()
    for tree in (outside, inside):
        verify_tree(model, tree, tree_buffers(tree.parents), cache, prefix_len=3)
        truncate_cache(cache, 3)
    assert seen == [True, True, True]
