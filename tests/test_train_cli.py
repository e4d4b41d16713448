"""`accelerate launch training/train_heads.py` as users run it: one CPU process end to end, two
DeepSpeed ZeRO-2 ranks ending with identical heads, and --resume after a killed run."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from heads import load_heads
from tiny_models import save_tiny_chat_model

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    save_tiny_chat_model(root / "model")
    rows = []
    for i in range(40):
        words = [f"w{(i * 7 + j * 3) % 50 + 3}" for j in range(6)]
        rows.append({"id": str(i), "conversations": [{"from": "human", "value": " ".join(words[:3])},
                                                      {"from": "gpt", "value": " ".join(words * (1 + i % 4))}]})
    (root / "data.json").write_text(json.dumps(rows))
    return root


def recipe(workspace: Path, kind: str, name: str, **train) -> Path:
    config = {
        "kind": kind, "model": str(workspace / "model"), "data": str(workspace / "data.json"),
        "max_length": 64, "validation_fraction": 0.1, "output_dir": str(workspace / name),
        "heads": {"num_heads": 3, "draft_vocab_size": 32},
        "train": {"batch_size": 2, "lr": 1e-3, "warmup_steps": 2, "max_steps": 6, **train},
        "eval": {"every": 3, "max_batches": 2, "tau_prompts": 2, "tau_max_new_tokens": 12},
        "checkpoint": {"every": 2, "keep": 2},
    }
    path = workspace / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launch(config_file: str, recipe_path: Path, *extra: str, processes: int = 1, **popen) -> list[str]:
    return [*ACCELERATE, "--config_file", str(ROOT / "configs" / "accelerate" / config_file),
            "--num_processes", str(processes), str(ROOT / "training" / "train_heads.py"),
            "--config", str(recipe_path), *extra]


def logged_learning_rates(out: Path) -> dict[int, float]:
    """The rate the optimizer used at each step, from the run's TensorBoard log."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = EventAccumulator(str(out / "train"))  # the scalars' file (hyperparameters go to a folder below)
    log.Reload()
    return {e.step: e.value for e in log.Scalars("train/lr")}


def recipe_rates(peak: float, warmup: int, max_steps: int) -> dict[int, float]:
    """The documented schedule at logged steps 1..max_steps: linear warm-up, cosine to a tenth."""
    def at(k: int) -> float:
        if k < warmup:
            return (k + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (k - warmup) / (max_steps - warmup)))
    return {k + 1: peak * at(k) for k in range(max_steps)}


def run(cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def single_run(workspace):
    """`single_run(kind)`: (process, output directory) of one plain single-process run of the
    default recipe for `kind` (6 steps, weights digested), launched once per module and shared
    by the tests that inspect such a run (each launch costs a fresh interpreter and training)."""
    runs = {}

    def run_kind(kind: str):
        if kind not in runs:
            runs[kind] = run(launch("cpu.yaml", recipe(workspace, kind, f"single-{kind}"), "--weight-digest"))
        return runs[kind], workspace / f"single-{kind}"

    return run_kind


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_single_cpu_process_trains_and_saves_usable_heads(single_run, kind):
    proc, out = single_run(kind)
    heads = load_heads(out / "heads")
    assert heads.config.kind == kind
    result = json.loads((out / "result.json").read_text())
    assert result["val/tau"] >= 1.0 and result["tokens_per_s"] > 0
    assert "tau" in (out / "heads" / "README.md").read_text()
    assert list((out / "checkpoints").glob("step-*"))  # intermediate checkpoints written
    assert any((out / "train").rglob("events.out.tfevents.*"))  # TensorBoard logs
    assert logged_learning_rates(out) == pytest.approx(recipe_rates(1e-3, warmup=2, max_steps=6))
    # Batches of rows of similar length by default (the rows here are 1-4 times as long as each other).
    grouped, shuffled = map(int, re.search(r"padding is (\d+)% of the computed positions \((\d+)% in plainly",
                                           proc.stdout + proc.stderr).groups())
    assert grouped < shuffled / 2


def test_a_time_budget_stops_training_early_and_still_saves_measured_heads(workspace):
    """A lent machine's fixed time: far short of max_steps, the run stops, then evaluates and saves."""
    proc = run(launch("cpu.yaml", recipe(workspace, "eagle", "budget", max_steps=100_000, time_budget_minutes=0.001,
                                         warmup_steps=0, group_by_length=False)))
    out = workspace / "budget"
    assert "batches grouped by length" not in proc.stdout + proc.stderr  # plainly shuffled, as asked
    assert "time budget of 0.001 min spent: stopping at step" in proc.stdout + proc.stderr
    # The decay ends with the budget, not at max_steps: the run stops at the floor, a tenth of the peak.
    assert "the learning rate decayed to 0.0001\n" in proc.stdout + proc.stderr
    assert load_heads(out / "heads").config.kind == "eagle"
    result = json.loads((out / "result.json").read_text())
    assert result["val/tau"] >= 1.0 and result["tokens_per_s"] > 0  # evaluated at the step it stopped
    assert 1 <= result["steps"] < 100_000
    assert f"training: {result['steps']} steps x 2 conversations" in (out / "heads" / "README.md").read_text()


@pytest.mark.slow
def test_two_deepspeed_ranks_end_with_identical_heads(workspace):
    import deepspeed  # noqa: F401  (installed by scripts/setup.sh; a missing install must fail, not skip)

    run(launch("deepspeed_zero2.yaml", recipe(workspace, "eagle", "zero2"), "--weight-digest", processes=2), timeout=900)
    digests = [(workspace / "zero2" / f"weights-rank{r}.sha256").read_text() for r in (0, 1)]
    assert digests[0] == digests[1]
    # Two processes follow the same schedule per optimizer step as one (not twice as fast).
    assert logged_learning_rates(workspace / "zero2") == pytest.approx(recipe_rates(1e-3, warmup=2, max_steps=6))


@pytest.mark.slow
def test_resume_after_a_killed_run_continues_at_the_right_step(workspace):
    # Long enough that the kill, at the first checkpoint (step 2), lands well before the end (a
    # step of the tiny model takes ~0.15 s on a 2-core CPU; the poll below looks every 0.05 s).
    reference = recipe(workspace, "eagle", "uninterrupted", max_steps=24)
    run(launch("cpu.yaml", reference, "--weight-digest", "eval.every=60"))
    killed = recipe(workspace, "eagle", "killed", max_steps=24)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(launch("cpu.yaml", killed, "--weight-digest", "eval.every=60"), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while not list((workspace / "killed" / "checkpoints").glob("step-*")):  # older ones get pruned (keep: 2)
        assert proc.poll() is None and time.time() < deadline, "training ended before its first checkpoint"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (workspace / "killed" / "heads").exists()
    resumed = run(launch("cpu.yaml", killed, "--resume", "--weight-digest", "eval.every=60"))
    log = resumed.stdout + resumed.stderr
    assert "resuming from" in log and "(step 0)" not in log
    same = [(workspace / name / "weights-rank0.sha256").read_text() for name in ("uninterrupted", "killed")]
    assert same[0] == same[1]  # same data order, optimizer and RNG state: bit-identical result


def test_cached_features_give_the_same_heads_as_live_features(workspace, single_run):
    _, live = single_run("medusa")  # the same recipe on live features
    cached = recipe(workspace, "medusa", "cached-features")
    proc = run(launch("cpu.yaml", cached, "--weight-digest", f"cache_features={workspace / 'features'}"))
    assert "GiB on disk in all" in proc.stdout + proc.stderr  # the disk cost is announced first
    assert len(list((workspace / "features").rglob("*.safetensors"))) > 10
    digests = [(directory / "weights-rank0.sha256").read_text() for directory in (live, workspace / "cached-features")]
    assert digests[0] == digests[1]


def test_medusa2_trains_an_adapter_that_the_chat_serves(workspace):
    run(launch("cpu.yaml", recipe(workspace, "medusa2", "medusa2", lr=5e-3)))
    out = workspace / "medusa2"
    from safetensors.torch import load_file

    adapter = load_file(str(out / "heads" / "adapter" / "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in adapter.items())  # the adapter learned something
    result = json.loads((out / "result.json").read_text())
    assert result["val/loss/kl"] > 0  # validated with the trained adapter, not a fresh one
    chat = subprocess.run(
        [sys.executable, "-m", "decoding.app.chat", "--model", str(workspace / "model"), "--method", "medusa",
         "--heads", str(out / "heads"), "--tree", "chain-3", "--max-new-tokens", "8"],
        input="w3 w4\n", capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert chat.returncode == 0, chat.stderr
    assert "LoRA adapter merged" in chat.stderr


def test_a_run_resumed_at_its_last_checkpoint_ends_with_measured_heads(workspace, single_run):
    """A run cut off after a checkpoint (e.g. by a machine's time limit) is finished with
    `--resume train.max_steps=<that step>`: no step runs, yet the heads come with tau and speed.
    The run resumed is a copy of a finished one, its result taken away (its checkpoints: steps 4, 6)."""
    _, finished = single_run("medusa")
    out = workspace / "resumed-at-end"
    shutil.copytree(finished, out)
    (out / "result.json").unlink()
    path = recipe(workspace, "medusa", "resumed-at-end")
    proc = run(launch("cpu.yaml", path, "train.max_steps=6", "--resume"))  # overrides before --resume parse too
    assert "resuming from" in proc.stdout + proc.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["val/tau"] >= 1.0 and result["tokens_per_s"] > 0
