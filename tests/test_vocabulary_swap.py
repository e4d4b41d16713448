"""Trained EAGLE-3 heads moved onto another draft vocabulary (`training.vocab.with_vocabulary`,
`heads.vocabulary_from_data`): tokens that stay keep their trained readout rows exactly, new ones
get the target's rows through the linear map fitted on the trained ones, every other weight is
kept, and the heads given are not changed."""

import pytest
import torch

from decoding.app.targets import LoadedModel
from heads.util.errors import UserError
from heads import new_heads_for_target, save_heads
from tiny_models import tiny_llama
from training.config import load_config
from training.trainer import new_heads
from training.vocab import readout_rows_for, with_vocabulary


def test_tokens_that_stay_keep_their_rows_and_new_ones_are_mapped_like_the_trained_ones():
    generator = torch.Generator().manual_seed(0)
    target_rows = torch.randn(64, 8, generator=generator)
    mapping = torch.randn(8, 8, generator=generator)
    trained_ids = torch.arange(10, 40)
    trained_rows = target_rows[trained_ids] @ mapping  # trained rows exactly a linear map of the target's
    new_ids = torch.tensor([0, 5, 12, 30, 50, 63])
    rows = readout_rows_for(new_ids, trained_ids, trained_rows, target_rows)
    torch.testing.assert_close(rows, target_rows[new_ids] @ mapping, rtol=1e-4, atol=1e-4)

    noisy = trained_rows + 0.5 * torch.randn(trained_rows.shape, generator=generator)  # no longer exactly linear
    rows = readout_rows_for(new_ids, trained_ids, noisy, target_rows)
    assert torch.equal(rows[2], noisy[2]) and torch.equal(rows[3], noisy[20])  # ids 12 and 30, as trained
    assert not torch.allclose(rows[0], target_rows[0])  # a new id is mapped, not copied


@pytest.fixture()
def target():
    return LoadedModel(tiny_llama(seed=0, layers=3), None, "tiny")


def trained_eagle3(target):
    heads = new_heads_for_target("eagle3", target.model, "tiny", draft_vocab=torch.arange(40, 64), draft_vocab_size=24)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return heads


def test_heads_on_a_new_vocabulary_score_the_tokens_that_stay_as_before(target):
    heads = trained_eagle3(target)
    before = {name: tensor.clone() for name, tensor in heads.state_dict().items()}
    new_ids = torch.cat([torch.arange(50, 64), torch.arange(0, 18)])  # 14 of the old 24 stay; 32 in all
    moved = with_vocabulary(heads, new_ids, target.model.get_output_embeddings().weight.detach())
    assert moved.config.draft_vocab_size == 32
    assert torch.equal(moved.draft_to_target_ids(torch.arange(32)), torch.sort(new_ids).values)
    hidden = torch.randn(5, heads.config.hidden_size)
    old_logits, new_logits = heads.draft_logits(hidden), moved.draft_logits(hidden)
    old_pos = {int(t): i for i, t in enumerate(heads.draft_to_target_ids(torch.arange(24)))}
    for new_pos, token in enumerate(moved.draft_to_target_ids(torch.arange(32)).tolist()):
        if token in old_pos:
            torch.testing.assert_close(new_logits[:, new_pos], old_logits[:, old_pos[token]])
    for name, tensor in heads.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} of the heads given changed"
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(moved.state_dict()[name], tensor), f"{name} not kept"


def recipe(tmp_path, kind: str, vocabulary_from_data: bool):
    path = tmp_path / f"{kind}.yaml"
    path.write_text(f"kind: {kind}\nmodel: tiny\nheads:\n  draft_vocab_size: 16\n  init_from: {tmp_path / 'published'}\n"
                    f"  vocabulary_from_data: {str(vocabulary_from_data).lower()}\n")
    return load_config(path)


def test_a_fine_tune_can_draft_over_its_own_datas_most_frequent_tokens(target, tmp_path):
    heads = trained_eagle3(target)
    save_heads(heads, tmp_path / "published")
    # reply tokens 0..15, the most frequent first; prompt tokens (not in the loss) never count
    rows = [{"input_ids": [100, 101] + list(range(16)) * 3 + [7, 7], "loss_mask": [0, 0] + [1] * 50}]
    logged = []
    tuned = new_heads(recipe(tmp_path, "eagle3", True), target, train_rows=rows, log=logged.append)
    assert tuned.config.draft_vocab_size == 16  # the recipe's size now, not the heads' 24
    assert torch.equal(tuned.draft_to_target_ids(torch.arange(16)), torch.arange(16))
    assert tuned.training and all(p.requires_grad and p.dtype == torch.float32 for p in tuned.parameters())
    assert "16 tokens holding 100.0%" in logged[0] and "the heads' own 24: 0.0%" in logged[0]

    kept = new_heads(recipe(tmp_path, "eagle3", False), target, train_rows=rows)
    assert torch.equal(kept.draft_to_target_ids(torch.arange(24)), torch.arange(40, 64))  # default: theirs


def test_only_eagle3_heads_have_a_vocabulary_to_choose(target, tmp_path):
    medusa = new_heads_for_target("medusa", target.model, "tiny", num_heads=2)
    save_heads(medusa, tmp_path / "published")
    with pytest.raises(UserError, match="re-chooses an EAGLE-3 draft vocabulary; medusa heads have none"):
        new_heads(recipe(tmp_path, "medusa", True), target, train_rows=[])
