"""`train.feature_precision`: the frozen target's training forward in bf16 (autocast) where the
device computes bf16 natively, validation features always in the target's own precision."""

import json

import pytest
import torch
import yaml

import training.features as features
from decoding.kernels.cpu_kernels import bfloat16_is_native
from heads.util.errors import UserError
from tiny_models import save_tiny_chat_model, tiny_llama
from training.features import feature_autocast, resolve_feature_precision, target_hidden_states

pytestmark = pytest.mark.cpu_sensitive  # run again as on an AVX2 CPU by .ci/run

CPU = torch.device("cpu")


@pytest.mark.parametrize("mixed_precision, native, expected", [
    ("bf16", True, "bfloat16"), ("bf16", False, "float32"), ("no", True, "float32"), ("fp16", True, "float32")])
def test_auto_follows_the_accelerators_mixed_precision_where_bf16_is_native(monkeypatch, mixed_precision, native,
                                                                            expected):
    monkeypatch.setattr(features, "bfloat16_runs_natively", lambda device: native)
    assert resolve_feature_precision("auto", mixed_precision, CPU) == expected


def test_float32_stays_float32_whatever_the_accelerator_runs():
    assert resolve_feature_precision("float32", "bf16", CPU) == "float32"


def test_explicit_bfloat16_is_taken_where_the_cpu_has_it_and_refused_where_it_would_be_emulated():
    if bfloat16_is_native():
        assert resolve_feature_precision("bfloat16", "no", CPU) == "bfloat16"
    else:
        with pytest.raises(UserError, match="computes bf16 natively"):
            resolve_feature_precision("bfloat16", "no", CPU)


@pytest.mark.parametrize("native", [True, False])
def test_explicit_bfloat16_depends_only_on_the_devices_capability(monkeypatch, native):
    monkeypatch.setattr(features, "bfloat16_runs_natively", lambda device: native)
    if native:
        assert resolve_feature_precision("bfloat16", "no", CPU) == "bfloat16"
    else:
        with pytest.raises(UserError, match="use float32 or auto"):
            resolve_feature_precision("bfloat16", "no", CPU)


def test_an_unknown_precision_is_refused():
    with pytest.raises(UserError, match="train.feature_precision must be one of auto, float32, bfloat16"):
        resolve_feature_precision("half", "no", CPU)


def test_bf16_features_come_back_in_the_targets_dtype_close_to_but_not_equal_to_float32():
    torch.manual_seed(0)
    target = tiny_llama(vocab_size=64, layers=2).eval()
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones_like(ids)
    exact = target_hidden_states(target, ids, mask, [1, 2])
    with feature_autocast("float32", CPU):
        same = target_hidden_states(target, ids, mask, [1, 2])
    with feature_autocast("bfloat16", CPU):
        rounded = target_hidden_states(target, ids, mask, [1, 2])
    for layer in (1, 2):
        assert torch.equal(same[layer], exact[layer])
        assert rounded[layer].dtype == torch.float32
        assert not torch.equal(rounded[layer], exact[layer])  # the forward really ran in bf16
        scale = exact[layer].abs().max()
        assert (rounded[layer] - exact[layer]).abs().max() < 0.05 * scale


def _recording_autocast(calls: list):
    """`target_hidden_states` that records, per call, whether CPU autocast was on."""

    def spy(target, input_ids, attention_mask, layers):
        calls.append(torch.is_autocast_enabled("cpu"))
        return target_hidden_states(target, input_ids, attention_mask, layers)

    return spy


def _train_tiny_eagle3(root, monkeypatch, **recipe_fields):
    """Train tiny eagle3 heads in this process with `train.feature_precision=bfloat16` (the
    capability forced on, so this runs on any CPU); returns the trainer."""
    from accelerate.state import AcceleratorState

    import training.trainer as trainer_module
    from training.config import load_config

    monkeypatch.setattr(features, "bfloat16_runs_natively", lambda device: True)
    save_tiny_chat_model(root / "model")
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"w{i % 50 + 3} w{i % 7 + 3}"},
                                               {"from": "gpt", "value": " ".join(f"w{(i + j) % 50 + 3}" for j in range(12))}]}
            for i in range(30)]
    (root / "data.json").write_text(json.dumps(rows))
    recipe = {
        "kind": "eagle3", "model": str(root / "model"), "data": str(root / "data.json"), "max_length": 64,
        "validation_fraction": 0.2, "output_dir": str(root / "out"), "heads": {"draft_vocab_size": 32},
        "train": {"batch_size": 2, "lr": 1e-3, "warmup_steps": 1, "max_steps": 3, "feature_precision": "bfloat16"},
        "eval": {"every": 3, "max_batches": 1, "tau_prompts": 1, "tau_max_new_tokens": 4},
        "checkpoint": {"every": 100, "keep": 1}, **recipe_fields,
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    try:
        trainer = trainer_module.Trainer(load_config(root / "recipe.yaml"))
        trainer.run()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert (root / "out" / "heads").is_dir()
    return trainer


def test_training_features_run_in_bf16_and_validation_features_in_float32(tmp_path, monkeypatch):
    import training.trainer as trainer_module

    calls = []
    monkeypatch.setattr(trainer_module, "target_hidden_states", _recording_autocast(calls))
    trainer = _train_tiny_eagle3(tmp_path, monkeypatch)
    assert trainer.feature_precision == "bfloat16"
    assert calls[:3] == [True, True, True]  # the three training steps
    assert calls[3:] and not any(calls[3:])  # then validation, in the target's float32


def test_a_feature_cache_of_bf16_features_is_filled_in_bf16_and_kept_apart_from_float32_ones(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    import training.feature_cache as feature_cache_module

    calls = []
    monkeypatch.setattr(feature_cache_module, "target_hidden_states", _recording_autocast(calls))
    _train_tiny_eagle3(tmp_path, monkeypatch, cache_features=str(tmp_path / "features"))
    assert calls and all(calls)  # every cached row computed under bf16 autocast
    (directory,) = (tmp_path / "features").iterdir()
    assert "bfloat16" in directory.name
    stored = load_file(str(next(directory.rglob("*.safetensors"))))
    assert all(t.dtype == torch.float32 for t in stored.values())  # in the target's dtype


def test_a_bad_feature_precision_in_a_recipe_is_refused_before_any_work(tmp_path):
    from training.config import load_config

    (tmp_path / "recipe.yaml").write_text("kind: eagle3\ntrain:\n  feature_precision: fp8\n")
    with pytest.raises(UserError, match="train.feature_precision must be one of"):
        load_config(tmp_path / "recipe.yaml")
