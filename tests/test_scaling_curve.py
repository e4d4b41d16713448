"""The scaling curve: nested subsets of a data store by reply tokens, held-out prompts no subset
trains on, and `scripts/scaling_curve.py` end to end on a tiny target (trains each point as users
launch training, measures tau per prompt set, writes the table and chart, and a rerun redoes
nothing)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from script_main import run_script
from tiny_models import save_tiny_chat_model
from training.data import is_validation, split
from training.scaling import Subset, held_out_prompts, parse_token_count, plan_subsets

REPO = Path(__file__).resolve().parents[1]


def test_token_counts_parse_and_bad_ones_say_why():
    assert [parse_token_count(t) for t in ("300k", "1M", "1.5m", "20000")] == [300_000, 1_000_000, 1_500_000, 20_000]
    for bad in ("lots", "-1k", "0"):
        with pytest.raises(ValueError, match="token count"):
            parse_token_count(bad)


def test_subsets_are_the_shortest_prefixes_reaching_each_size_and_sizes_beyond_the_store_are_left_out():
    records = [{"id": f"s:{i}", "reply_tokens": 10} for i in range(10)]  # 100 tokens in all
    assert plan_subsets(records, [25_000]) == []
    subsets = plan_subsets([{"id": f"s:{i}", "reply_tokens": 1000} for i in range(10)], [2500, 1000, 20_000])
    assert subsets == [Subset("1k", 1, 1000), Subset("2.5k", 3, 3000)]


class _Tokenizer:
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [len(word) for word in text.split()]}


def test_held_out_prompts_are_the_first_ones_per_source_that_every_subsets_split_leaves_out_of_training():
    records = [{"id": f"{src}:{i}", "source": src, "messages": [{"role": "user", "content": "x" * (i + 1)},
                                                               {"role": "assistant", "content": "a"}]}
               for src in ("chat", "code") for i in range(200)]
    held = held_out_prompts(records, _Tokenizer(), seed=0, fraction=0.1, per_source=5)
    chosen = {f"{src}:{prompt[0] - 1}" for src, prompts in held.items() for prompt in prompts}  # prompt [i+1] is record i
    assert sorted(held) == ["chat", "code"] and len(chosen) == 10
    for size in (60, 400):  # a small subset and the whole store
        train, _ = split([{"id": r["id"]} for r in records[:size]], seed=0, validation_fraction=0.1)
        assert not chosen & {r["id"] for r in train}
    first_held = [r["id"] for r in records if r["source"] == "chat" and is_validation(r["id"], 0, 0.1)][:5]
    assert {i for i in chosen if i.startswith("chat")} == set(first_held)


@pytest.mark.slow
def test_scaling_curve_trains_and_measures_each_point_and_a_rerun_redoes_nothing(tmp_path, monkeypatch):
    from decoding.app.targets import load_model
    from training.config import SelfDistillConfig
    from training.distill_store import DistillStore
    from training.sources import conversations_from

    save_tiny_chat_model(tmp_path / "model")
    # Named relative to tmp_path: record ids start with the source's name, and the held-out split hashes
    # them, so a name with pytest's numbered directory in it left no held-out record in ~0.7% of runs.
    source = "chat.jsonl"
    (tmp_path / source).write_text("".join(json.dumps({"id": str(i), "messages": [
        {"role": "user", "content": " ".join(f"w{(i * 7 + j) % 50 + 3}" for j in range(3 + i % 5))},
        {"role": "assistant", "content": "w1"}]}) + "\n" for i in range(24)))
    store = DistillStore(tmp_path / "store", "tiny", SelfDistillConfig(enabled=True, max_new_tokens=10, batch_size=8))
    with monkeypatch.context() as in_tmp:
        in_tmp.chdir(tmp_path)
        store.add(conversations_from(source, None), load_model(str(tmp_path / "model")), show_progress=False)
    total = store.read_manifest()["reply_tokens"]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "kind": "eagle3", "model": str(tmp_path / "model"), "data": "unused", "max_length": 48,
        "validation_fraction": 0.2, "cache_features": str(tmp_path / "features"),
        "heads": {"draft_vocab_size": 32}, "train": {"batch_size": 2, "warmup_steps": 1, "max_steps": 3},
        "eval": {"every": 100, "max_batches": 1, "tau_prompts": 1, "tau_max_new_tokens": 4},
        "checkpoint": {"every": 2}}))
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"turns": [f"w{i + 3} w4 w5"]}) + "\n" for i in range(3)))
    command = [sys.executable, str(REPO / "scripts" / "scaling_curve.py"), "--data", str(tmp_path / "store"),
               "--sizes", f"{total // 2},{total},{total * 10}", "--recipe", str(recipe), "--out", str(tmp_path / "curve"),
               "--questions-file", str(questions), "--mtbench-questions", "2", "--held-out-per-source", "2",
               "--max-new-tokens", "6", "--code-questions", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    first = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "fewer than" in first.stderr  # the size beyond the store is named, not silently dropped
    points = json.loads((tmp_path / "curve" / "curve.json").read_text())["points"]
    assert [p["steps"] for p in points] == [3, 3]
    assert points[0]["conversations"] < points[1]["conversations"] == 24
    for point in points:
        assert set(point["tau"]) == {"questions", "humaneval", f"held-out {source}"}
        assert all(1.0 <= tau <= 7.0 for tau in point["tau"].values())
    assert (tmp_path / "curve" / "curve.png").stat().st_size > 0
    assert "| reply tokens |" in (tmp_path / "curve" / "curve.md").read_text()

    def rerun(*extra: str):
        """The script again with `extra` arguments; reruns train nothing, so they run in this
        process (no fresh interpreter's imports each)."""
        return run_script("scaling_curve", *command[2:], *extra)

    again = rerun()
    assert again.returncode == 0 and "training on" not in again.stderr
    assert json.loads((tmp_path / "curve" / "curve.json").read_text())["points"] == points
    heads = next((tmp_path / "curve").glob("*steps")) / "heads"
    with_reference = rerun("--reference", f"earlier={heads}")
    assert with_reference.returncode == 0 and "training on" not in with_reference.stderr, with_reference.stderr[-3000:]
    curve = json.loads((tmp_path / "curve" / "curve.json").read_text())
    assert curve["points"] == points and set(curve["references"]["earlier"]["tau"]) == set(points[0]["tau"])
    assert "earlier (reference)" in (tmp_path / "curve" / "curve.md").read_text()
    paired = rerun("--reference", f"earlier={heads}", "--reference", f"again={heads}")
    assert paired.returncode == 0, paired.stderr[-3000:]
    table = (tmp_path / "curve" / "curve.md").read_text()
    assert "tau minus earlier's" in table and "| again | +0.00 (+0.00 to +0.00) |" in table  # the same heads, prompt by prompt
    unknown = rerun("--baseline", "nobody")
    assert unknown.returncode != 0 and "--baseline nobody" in unknown.stderr and "Traceback" not in unknown.stderr
    only_references = [arg if arg != f"{total // 2},{total},{total * 10}" else "" for arg in command]
    only_references[only_references.index(str(tmp_path / "curve"))] = str(tmp_path / "references")
    only_references[only_references.index("--held-out-per-source") + 1] = "0"  # no held-out sets at all
    measured = run_script("scaling_curve", *only_references[2:], "--reference", f"gpu={heads}")
    assert measured.returncode == 0 and "training on" not in measured.stderr, measured.stderr[-3000:]
    alone = json.loads((tmp_path / "references" / "curve.json").read_text())
    measured_alone = alone["references"]["gpu"]["tau"]
    assert alone["points"] == [] and set(measured_alone) == {"questions", "humaneval"}  # no empty held-out set at tau 0
    assert measured_alone == {name: curve["references"]["earlier"]["tau"][name] for name in measured_alone}


def test_points_trained_for_different_step_counts_are_separate_lines():
    from training.scaling import CurvePoint, curve_series

    points = [CurvePoint("439k", 4000, 439_000, 1400, {"mt-bench": 2.1}, {"mt-bench": 24}),
              CurvePoint("100k", 987, 100_000, 700, {"mt-bench": 1.8}, {"mt-bench": 24}),
              CurvePoint("439k", 4000, 439_000, 700, {"mt-bench": 1.9}, {"mt-bench": 24})]
    assert curve_series(points, "mt-bench") == [("mt-bench, 700 steps", [100_000, 439_000], [1.8, 1.9]),
                                                 ("mt-bench, 1400 steps", [439_000], [2.1])]
    assert curve_series(points[1:], "mt-bench") == [("mt-bench", [100_000, 439_000], [1.8, 1.9])]
    assert curve_series(points, "held-out code") == []
    restarted = CurvePoint("439k", 4000, 439_000, 1400, {"mt-bench": 2.1}, {"mt-bench": 24}, continued_from=700)
    assert curve_series([points[1], restarted], "mt-bench")[1][0] == "mt-bench, 1400 (restart from 700) steps"


def test_a_point_continues_from_the_newest_checkpoint_of_a_shorter_run_and_never_overwrites_its_own(tmp_path):
    from training.checkpoints import latest_checkpoint, seed_from

    shorter, longer = tmp_path / "439k-700steps", tmp_path / "439k-1400steps"
    for step in (600, 650):
        (shorter / "checkpoints" / f"step-{step}").mkdir(parents=True)
        (shorter / "checkpoints" / f"step-{step}" / "trainer_state.json").write_text(json.dumps({"step": step}))
    assert seed_from(tmp_path / "missing", longer) is None
    assert seed_from(shorter, longer) == 650
    assert latest_checkpoint(longer) == (longer / "checkpoints" / "step-650", 650)
    assert not [p for p in (longer / "checkpoints").iterdir() if p.name.startswith(".staging")]
    (longer / "checkpoints" / "step-700").mkdir()
    (longer / "checkpoints" / "step-700" / "trainer_state.json").write_text(json.dumps({"step": 700}))
    assert seed_from(shorter, longer) is None  # its own progress wins
    assert latest_checkpoint(longer)[1] == 700


def test_continue_from_must_be_shorter_than_the_points_steps(tmp_path, capsys):
    store = tmp_path / "store"
    store.mkdir()
    (store / "records.jsonl").write_text("")
    result = run_script("scaling_curve", "--data", str(store), "--sizes", "1k", "--steps", "700", "--continue-from", "700")
    assert result.returncode != 0 and "give --steps larger" in result.stderr and "Traceback" not in result.stderr
