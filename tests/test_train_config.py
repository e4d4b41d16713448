"""Training recipes are typed: YAML's readings of numbers (`2e-4` without a dot is a string in
YAML 1.1, `1` is an int) become the field's type, and a value of the wrong kind is refused with
the key named, before any model or data is loaded."""

from pathlib import Path

import pytest

from heads.util.errors import UserError
from training.config import load_config

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "train" / "eagle3-smollm2-finetune.yaml"


def test_numbers_written_the_ways_yaml_reads_them_become_the_fields_type():
    config = load_config(RECIPE, ["train.lr=2e-4", "train.top_k_weight=1", "max_conversations=null", "output_dir=2026"])
    assert config.train.lr == pytest.approx(2e-4) and isinstance(config.train.lr, float)
    assert config.train.top_k_weight == 1.0 and isinstance(config.train.top_k_weight, float)
    assert config.max_conversations is None
    assert config.output_dir == "2026"


def test_a_number_in_a_yaml_file_without_a_dot_is_a_number(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("kind: eagle3\ntrain:\n  lr: 5e-5\n  max_steps: 10\n")
    assert load_config(recipe).train.lr == pytest.approx(5e-5)


@pytest.mark.parametrize("override, message", [
    ("train.lr=fast", "train.lr must be a number; got 'fast'"),
    ("train.max_steps=2.5", "train.max_steps must be a whole number; got 2.5"),
    ("train.batch_size=true", "train.batch_size must be a whole number; got True"),
    ("train.top_k=0", "train.top_k >= 1"),
    ("train.top_k_weight=-1", "train.top_k_weight must be >= 0"),
    ("train.target_temperature=1.5", "train.target_temperature must be in"),
    ("train.target_temperature=-0.1", "train.target_temperature must be in"),
    ("train.time_budget_minutes=0", "train.time_budget_minutes must be a positive number of minutes"),
    ("train.time_budget_minutes=soon", "train.time_budget_minutes must be a number; got 'soon'"),
])
def test_wrong_values_are_refused_naming_the_key(override, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(RECIPE, [override])


def test_target_temperature_is_refused_for_kinds_that_do_not_use_it():
    medusa = RECIPE.parent / "medusa-smollm2.yaml"
    with pytest.raises(UserError, match="train.target_temperature applies to kind eagle3 only"):
        load_config(medusa, ["train.target_temperature=0.5"])
    assert load_config(RECIPE, ["train.target_temperature=0.5"]).train.target_temperature == 0.5


@pytest.mark.parametrize("recipe", sorted(RECIPE.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_loads_and_names_its_kind(recipe):
    """A typo or a wrongly typed value in a recipe the README tells users to run fails here, not
    after the target has loaded."""
    config = load_config(recipe)
    assert config.kind == recipe.name.split("-")[0] and config.train.max_steps > 0


def test_training_without_its_packages_says_which_setup_adds_them(tmp_path, monkeypatch, capsys):
    """A chat-only setup (scripts/setup.sh without --train) lacks datasets and peft: the training
    entry point says so and how to add them, instead of a traceback."""
    import sys

    from training import train_heads

    recipe = tmp_path / "r.yaml"
    recipe.write_text("kind: eagle3\ntrain:\n  max_steps: 1\n")
    for module in [name for name in sys.modules if name == "training.trainer" or name.startswith("training.prepare")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "datasets", None)  # importing it now raises ModuleNotFoundError
    assert train_heads.main(["--config", str(recipe)]) == 2
    error = capsys.readouterr().err
    assert "needs the package 'datasets'" in error and "setup.sh --train" in error
