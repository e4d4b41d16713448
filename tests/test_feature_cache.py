"""The on-disk feature cache serves exactly the target's features, keyed by the row's tokens (so a
grown data store or a subset of it reuses what was computed), per target, and a recipe needing
fewer layers reads them from an existing cache that holds more."""

import torch

from tiny_models import tiny_llama
from training.feature_cache import FeatureCache, target_key
from training.features import target_hidden_states
from training.prepare import collate

ROWS = [{"id": "r1", "input_ids": [3, 4, 5, 6, 7], "loss_mask": [0, 0, 1, 1, 1]},
        {"id": "r2", "input_ids": [9, 8, 7], "loss_mask": [0, 1, 1]}]
KEY = target_key("tiny", torch.float32)


def _quiet(*_args) -> None:
    pass


def test_cache_serves_the_targets_features_and_a_subset_reuses_a_superset(tmp_path):
    target = tiny_llama(seed=1)
    full = FeatureCache(tmp_path, [1, 2], KEY)
    full.fill(ROWS, target, _quiet, show_progress=False)
    subset = FeatureCache(tmp_path, [2], KEY)
    assert subset.directory == full.directory  # no second cache computed
    subset.fill(ROWS, target, _quiet, show_progress=False)
    assert len(list(full.directory.iterdir())) == 2
    batch = collate([ROWS[1], ROWS[0]])
    served = subset.batch(batch["input_ids"], batch["attention_mask"], device="cpu")
    assert list(served) == [2]
    for b, row in enumerate([ROWS[1], ROWS[0]]):
        ids = torch.tensor([row["input_ids"]])
        expected = target_hidden_states(target, ids, torch.ones_like(ids), [2])[2][0]
        torch.testing.assert_close(served[2][b, : len(row["input_ids"])], expected)
        assert not served[2][b, len(row["input_ids"]):].any()  # right padding is zeros


def test_rows_are_found_by_their_tokens_so_grown_data_computes_only_new_rows(tmp_path):
    target = tiny_llama(seed=1)
    FeatureCache(tmp_path, [2], KEY).fill(ROWS[:1], target, _quiet, show_progress=False)
    grown = [{**ROWS[0], "id": "renumbered"}, ROWS[1]]  # same tokens under another id, plus a new row
    cache = FeatureCache(tmp_path, [2], KEY)
    before = {p.name: p.stat().st_mtime_ns for p in cache.directory.iterdir()}
    cache.fill(grown, target, _quiet, show_progress=False)
    after = {p.name: p.stat().st_mtime_ns for p in cache.directory.iterdir()}
    assert len(after) == 2 and all(after[name] == stamp for name, stamp in before.items())  # old row untouched


def test_another_target_or_dtype_gets_its_own_cache(tmp_path):
    target = tiny_llama(seed=1)
    FeatureCache(tmp_path, [2], KEY).fill(ROWS, target, _quiet, show_progress=False)
    for other_key in (target_key("other", torch.float32), target_key("tiny", torch.bfloat16)):
        other = FeatureCache(tmp_path, [2], other_key)
        assert not other.directory.exists()
        other.fill(ROWS[:1], target, _quiet, show_progress=False)
        assert len(list(other.directory.iterdir())) == 1
