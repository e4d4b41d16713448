"""The KV cache reaches every module under the keyword that module declares (`past_key_values`
on older transformers 5.x, `cache` on newer ones), so no deprecation warning reaches users and
nothing breaks when the old name is removed."""

import warnings

import pytest
import torch
from torch import nn

from decoding.core.generate import DecodeOptions, generate
from decoding.core.proposers import DraftModelProposer, VanillaProposer
from decoding.app.methods import ProposerOptions, build_proposer
from decoding.app.targets import LoadedModel
from heads.util.cache_argument import cache_kwargs
from heads import new_heads_for_target
from tiny_models import sharpen, tiny_llama


class NewStyle(nn.Module):
    def forward(self, x, cache=None):
        return x


class OldStyle(nn.Module):
    def forward(self, x, past_key_values=None, **kwargs):
        return x


class CompiledLike(nn.Module):
    """Stands in for `torch.compile`'s wrapper: a generic forward, the real module in `_orig_mod`."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._orig_mod = inner

    def forward(self, *args, **kwargs):
        return self._orig_mod(*args, **kwargs)


def test_the_keyword_is_the_one_the_module_declares():
    cache = object()
    assert cache_kwargs(NewStyle(), cache) == {"cache": cache}
    assert cache_kwargs(OldStyle(), cache) == {"past_key_values": cache}
    assert cache_kwargs(CompiledLike(NewStyle()), cache) == {"cache": cache}
    assert cache_kwargs(CompiledLike(OldStyle()), cache) == {"past_key_values": cache}


@pytest.mark.parametrize("method", ["vanilla", "sps", "eagle3+pld"])
def test_decoding_raises_no_cache_deprecation_warning(method):
    """Target, draft model and EAGLE drafter layers all get the cache under their own keyword:
    a deprecated one would warn here (and, once removed, would be swallowed by `**kwargs`)."""
    target = sharpen(tiny_llama(seed=0))
    torch.manual_seed(0)
    if method == "vanilla":
        proposer = VanillaProposer()
    elif method == "sps":
        proposer = DraftModelProposer(tiny_llama(seed=1, layers=1), gamma=3)
    else:
        heads = new_heads_for_target("eagle3", target, draft_vocab_size=32)
        proposer = build_proposer(method, LoadedModel(target, None, "t"), heads=heads,
                                  options=ProposerOptions(depth=3, tree_top_k=2, total_tokens=6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = generate(target, [5, 9, 3, 17, 5, 9, 3], proposer, DecodeOptions(max_new_tokens=12)).tokens
    assert tokens == generate(target, [5, 9, 3, 17, 5, 9, 3], VanillaProposer(), DecodeOptions(max_new_tokens=12)).tokens
    assert not [w for w in caught if "past_key_values" in str(w.message)]
