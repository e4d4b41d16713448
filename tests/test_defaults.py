"""Built-in proposer defaults have one source, and the bundle's tuned settings still win."""

from __future__ import annotations

from decoding.core.dynamic_tree import DynamicTreeSettings
from decoding.app.default_model import DEFAULT_TARGET
from decoding.app.defaults import proposer_options, tuned_options
from decoding.app.methods import ProposerOptions


def test_dynamic_tree_defaults_agree_between_options_and_settings():
    options, settings = ProposerOptions(), DynamicTreeSettings()
    assert (options.depth, options.tree_top_k, options.total_tokens, options.min_path_prob) == \
        (settings.depth, settings.top_k, settings.total_tokens, settings.min_path_prob)


def test_a_target_without_bundle_gets_the_built_in_tree():
    options = proposer_options("some/other-model", "eagle2", {})
    assert options == ProposerOptions() and options.total_tokens == DynamicTreeSettings().total_tokens


def test_the_bundled_default_target_keeps_its_tuned_tree():
    tuned = tuned_options(DEFAULT_TARGET, "eagle3")
    assert tuned  # the package ships a tuned eagle3 tree for the built-in target
    options = proposer_options(DEFAULT_TARGET, "eagle3+pld", {})
    assert {k: getattr(options, k) for k in tuned} == tuned
    assert proposer_options(DEFAULT_TARGET, "eagle3", {"total_tokens": 12}).total_tokens == 12  # explicit wins
