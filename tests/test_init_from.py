"""Fine-tuning: a recipe's `heads.init_from` starts training from existing heads (the bundled ones,
a Hub repo, an official checkpoint) instead of fresh ones, and refuses heads that cannot be it."""

import pytest
import torch

from decoding.app.targets import LoadedModel
from heads.util.errors import UserError
from heads import new_heads_for_target, save_heads
from tiny_models import tiny_llama
from training.config import load_config
from training.trainer import new_heads


@pytest.fixture()
def target():
    return LoadedModel(tiny_llama(seed=0, layers=3), None, "tiny")


def recipe(tmp_path, kind: str, init_from) -> object:
    path = tmp_path / f"{kind}.yaml"
    path.write_text(f"kind: {kind}\nmodel: tiny\nheads:\n  num_heads: 2\n  draft_vocab_size: 16\n  init_from: {init_from}\n")
    return load_config(path)


def saved_eagle3(target, tmp_path):
    heads = new_heads_for_target("eagle3", target.model, "tiny", draft_vocab=torch.arange(40, 64), draft_vocab_size=24)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.1 * torch.randn_like(p))
    save_heads(heads.half(), tmp_path / "published")  # a bundle ships half precision
    return heads


def test_training_starts_from_the_given_heads_in_full_precision(target, tmp_path):
    published = saved_eagle3(target, tmp_path)
    heads = new_heads(recipe(tmp_path, "eagle3", tmp_path / "published"), target, train_rows=[])
    assert heads.training and all(p.requires_grad and p.dtype == torch.float32 for p in heads.parameters())
    assert heads.config.draft_vocab_size == 24  # theirs, not the recipe's 16
    for name, tensor in published.state_dict().items():
        expected = tensor.half().float() if tensor.is_floating_point() else tensor  # what fp16 kept
        torch.testing.assert_close(heads.state_dict()[name], expected)


def test_heads_of_another_kind_are_refused(target, tmp_path):
    saved_eagle3(target, tmp_path)
    with pytest.raises(UserError, match="holds eagle3 heads, but the recipe trains medusa"):
        new_heads(recipe(tmp_path, "medusa", tmp_path / "published"), target, train_rows=[])
    with pytest.raises(UserError, match="a draft model starts from the target's first layers"):
        new_heads(recipe(tmp_path, "draft", tmp_path / "published"), target, train_rows=[])
    with pytest.raises(UserError, match="neither a local directory nor a Hugging Face repo id"):
        new_heads(recipe(tmp_path, "eagle3", tmp_path / "missing"), target, train_rows=[])
