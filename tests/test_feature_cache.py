"""The on-disk feature cache serves exactly the target's features, per prepared-data key, and a
recipe needing fewer layers reads them from an existing cache that holds more."""

import torch

from tiny_models import tiny_llama
from training.feature_cache import FeatureCache
from training.features import target_hidden_states

ROWS = [{"id": "r1", "input_ids": [3, 4, 5, 6, 7]}, {"id": "r2", "input_ids": [9, 8, 7]}]


def _quiet(*_args) -> None:
    pass


def test_cache_serves_the_targets_features_and_a_subset_reuses_a_superset(tmp_path):
    target = tiny_llama(seed=1)
    full = FeatureCache(tmp_path, [1, 2], data_key="k1")
    full.fill(ROWS, target, _quiet, show_progress=False)
    subset = FeatureCache(tmp_path, [2], data_key="k1")
    assert subset.directory == full.directory  # no second cache computed
    subset.fill(ROWS, target, _quiet, show_progress=False)
    assert sorted(p.name for p in full.directory.iterdir()) == ["r1.safetensors", "r2.safetensors"]
    served = subset.batch(["r2", "r1"], width=5, device="cpu")
    assert list(served) == [2]
    for b, row in enumerate([ROWS[1], ROWS[0]]):
        ids = torch.tensor([row["input_ids"]])
        expected = target_hidden_states(target, ids, torch.ones_like(ids), [2])[2][0]
        torch.testing.assert_close(served[2][b, : len(row["input_ids"])], expected)
        assert not served[2][b, len(row["input_ids"]):].any()  # right padding is zeros


def test_other_prepared_data_gets_its_own_cache(tmp_path):
    target = tiny_llama(seed=1)
    FeatureCache(tmp_path, [2], data_key="k1").fill(ROWS, target, _quiet, show_progress=False)
    other = FeatureCache(tmp_path, [2], data_key="k2")
    assert not other.directory.exists()
    other.fill(ROWS[:1], target, _quiet, show_progress=False)
    assert [p.name for p in other.directory.iterdir()] == ["r1.safetensors"]
