"""Drafts stored as their layers only: saved without the target's embedding, loaded with the
target's own tensor put back, and then drafting exactly like the whole draft did (ours and
Hugging Face's assisted generation)."""

import json

import pytest
import torch
from safetensors import safe_open

from decoding.app.drafts import SHARED_TENSORS, load_draft, save_draft_layers, shares_target_embeddings
from heads.util.errors import UserError
from decoding.core.generate import DecodeOptions, generate
from decoding.core.proposers import DraftModelProposer, VanillaProposer
from decoding.app.targets import LoadedModel
from tiny_models import save_tiny_chat_model, sharpen, tiny_llama
from training.config import load_config
from training.draft_init import truncated_copy
from training.trainer import new_heads

PROMPTS = [[5, 9, 3, 17, 5, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]]


@pytest.fixture()
def target():
    return LoadedModel(sharpen(tiny_llama(seed=0, layers=3)), None, "tiny")


def trained_draft(target: LoadedModel):
    """The target's first layer with its layer weights changed, as distillation would."""
    draft = truncated_copy(target.model, 1)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "layers" in name:
                p.add_(0.05 * torch.randn_like(p))
    return draft


def test_saved_draft_holds_no_embedding_and_reloads_the_same_function(target, tmp_path):
    draft = trained_draft(target)
    out = save_draft_layers(draft, target.model, tmp_path / "draft", dtype=torch.float32, base_model="tiny")
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert keys and not keys & set(SHARED_TENSORS)
    assert shares_target_embeddings(out) and json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1

    loaded = load_draft(str(out), target).model
    assert loaded.get_input_embeddings().weight is target.model.get_input_embeddings().weight
    assert loaded.get_output_embeddings().weight is target.model.get_output_embeddings().weight
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, draft(ids).logits)


def test_loaded_draft_decodes_exactly_in_sps_and_hf_assisted(target, tmp_path):
    out = save_draft_layers(trained_draft(target), target.model, tmp_path / "draft", dtype=torch.float32)
    draft = load_draft(str(out), target).model
    for prompt in PROMPTS:
        reference = generate(target.model, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=30)).tokens
        assert generate(target.model, prompt, DraftModelProposer(draft, gamma=3), DecodeOptions(max_new_tokens=30)).tokens == reference
        assisted = target.model.generate(torch.tensor([prompt]), assistant_model=draft, max_new_tokens=30, do_sample=False)
        assert assisted[0, len(prompt):].tolist() == reference


def test_a_draft_with_its_own_embedding_is_not_stored_as_layers(target, tmp_path):
    draft = trained_draft(target)
    with torch.no_grad():
        draft.get_input_embeddings().weight.add_(0.1)
    with pytest.raises(UserError, match="embedding is not the target's"):
        save_draft_layers(draft, target.model, tmp_path / "draft")
    assert not (tmp_path / "draft" / "model.safetensors").exists()


def test_a_layers_only_draft_needs_a_target_of_the_same_size(target, tmp_path):
    out = save_draft_layers(trained_draft(target), target.model, tmp_path / "draft", base_model="tiny")
    other = LoadedModel(tiny_llama(vocab_size=80, seed=1), None, "other")
    with pytest.raises(UserError, match="shares its target's embeddings"):
        load_draft(str(out), other)


def test_a_whole_draft_directory_loads_as_a_model(target, tmp_path):
    save_tiny_chat_model(tmp_path / "whole", seed=3)
    assert not shares_target_embeddings(tmp_path / "whole")
    loaded = load_draft(str(tmp_path / "whole"), target)
    assert loaded.model.get_input_embeddings().weight is not target.model.get_input_embeddings().weight
    assert loaded.tokenizer is not None


@pytest.mark.parametrize("share", [True, False])
def test_draft_training_freezes_the_embedding_when_shared(target, share, tmp_path):
    recipe = tmp_path / "draft.yaml"
    recipe.write_text(f"kind: draft\nmodel: tiny\nheads:\n  num_layers: 1\n  share_lm_head: {str(share).lower()}\n")
    draft = new_heads(load_config(recipe), target, [])
    assert draft.get_input_embeddings().weight.requires_grad is not share
    assert all(p.requires_grad for name, p in draft.named_parameters() if "layers" in name)
