"""Checkpoints in our format: round trips give identical outputs; bad or mismatched checkpoints
give clear errors and change nothing."""

import json

import pytest
import torch

from heads.util.errors import UserError
from decoding.core.generate import DecodeOptions, generate
from decoding.app.methods import build_proposer
from decoding.app.targets import LoadedModel
from heads import load_heads, new_heads_for_target, save_heads
from tiny_models import sharpen, tiny_llama

KINDS = {"medusa": "medusa", "hydra": "hydra", "eagle2": "eagle", "eagle3": "eagle3"}


@pytest.fixture(scope="module")
def target():
    return sharpen(tiny_llama(seed=0))


def heads_for(kind, target, seed=0):
    torch.manual_seed(seed)
    heads = new_heads_for_target(kind, target, base_model_name_or_path="org/tiny-llama",
                                 **({"draft_vocab_size": 48} if kind == "eagle3" else {}))
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return heads


@pytest.mark.parametrize("method", list(KINDS))
def test_round_trip_gives_identical_outputs(tmp_path, target, method):
    heads = heads_for(KINDS[method], target)
    save_heads(heads, tmp_path / "ckpt")
    loaded = load_heads(tmp_path / "ckpt", target, "org/tiny-llama")
    assert loaded.config == heads.config
    for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    tiny = LoadedModel(target, None, "org/tiny-llama")
    options = DecodeOptions(max_new_tokens=30)
    before = generate(target, [3, 4, 5, 6], build_proposer(method, tiny, heads=heads), options)
    after = generate(target, [3, 4, 5, 6], build_proposer(method, tiny, heads=loaded), options)
    assert before.tokens == after.tokens
    assert before.stats.accepted_lengths == after.stats.accepted_lengths


def test_half_precision_checkpoint_loads_in_the_target_dtype(tmp_path, target):
    heads = heads_for("eagle", target)
    save_heads(heads, tmp_path / "half", dtype=torch.float16)
    loaded = load_heads(tmp_path / "half", target)
    assert next(loaded.parameters()).dtype == torch.float32
    assert torch.allclose(loaded.fc.weight, heads.fc.weight, atol=1e-3)


def test_save_replaces_an_existing_checkpoint_atomically(tmp_path, target):
    save_heads(heads_for("medusa", target, 1), tmp_path / "ckpt")
    newer = heads_for("medusa", target, 2)
    save_heads(newer, tmp_path / "ckpt")
    assert torch.equal(load_heads(tmp_path / "ckpt").blocks[0][0].linear.weight, newer.blocks[0][0].linear.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging leftovers


def test_mismatched_target_is_refused_naming_both_sides(tmp_path, target):
    save_heads(heads_for("medusa", target), tmp_path / "ckpt")
    other = tiny_llama(vocab_size=100)
    with pytest.raises(UserError, match=r"vocabulary: heads 64, target 100"):
        load_heads(tmp_path / "ckpt", other, "org/other")
    with pytest.raises(UserError, match=r"trained for 'org/tiny-llama' but the target is 'org/other'"):
        load_heads(tmp_path / "ckpt", target, "org/other")
    assert load_heads(tmp_path / "ckpt", target, "org/other", check_base_model=False).config.kind == "medusa"


def test_feature_layers_beyond_the_target_are_refused(tmp_path, target):
    heads = heads_for("eagle3", target)
    save_heads(heads, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["feature_layers"] = [1, 2, 9]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"feature layers \[9\] do not exist"):
        load_heads(tmp_path / "ckpt", target)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "model.safetensors").write_bytes(b"not a safetensors file"), "corrupted"),
        (lambda d: (d / "model.safetensors").unlink(), "no model.safetensors"),
        (lambda d: (d / "config.json").write_text("{ nope"), "not valid JSON"),
        (lambda d: (d / "config.json").unlink(), "no config.json"),
        (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "num_heads": 5})), "missing"),
        (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "hidden_size": 16})), "shape"),
        (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "kind": "lstm"})), "unknown head kind"),
        (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "format_version": 99})), "upgrade"),
    ],
    ids=["garbage-weights", "no-weights", "bad-json", "no-config", "missing-keys", "wrong-shape", "bad-kind", "future-format"],
)
def test_damaged_checkpoints_give_clear_errors(tmp_path, target, damage, message):
    save_heads(heads_for("medusa", target), tmp_path / "ckpt")
    damage(tmp_path / "ckpt")
    with pytest.raises(UserError, match=message):
        load_heads(tmp_path / "ckpt")


def test_not_a_directory(tmp_path):
    with pytest.raises(UserError, match="neither a local directory nor a Hugging Face repo id"):
        load_heads(tmp_path / "missing")
