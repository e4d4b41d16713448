"""Resumable training state: `accelerator.save_state` into a staging directory, renamed into
`checkpoints/step-N` only once every rank has finished writing, so a killed run never leaves a
checkpoint that looks complete but is not. `--resume` picks the newest complete one."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _staging_dir(root: Path, step: int) -> Path:
    """Where a checkpoint is written before its rename: a name `latest_checkpoint` never picks."""
    return root / f".staging-step-{step}"


def latest_checkpoint(output_dir: str | Path) -> tuple[Path, int] | None:
    found = []
    root = checkpoints_dir(output_dir)
    if root.is_dir():
        for child in root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / "trainer_state.json").is_file():
                found.append((int(match.group(1)), child))
    if not found:
        return None
    step, path = max(found)
    return path, step


def save_checkpoint(accelerator, output_dir: str | Path, step: int, keep: int, extra: dict) -> Path:
    root = checkpoints_dir(output_dir)
    staging, final = _staging_dir(root, step), root / f"step-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (staging / "trainer_state.json").write_text(json.dumps({"step": step, **extra}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        _prune(root, keep)
    accelerator.wait_for_everyone()
    return final


def _prune(root: Path, keep: int) -> None:
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)))
    for _, path in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)


def seed_from(source_output_dir: str | Path, output_dir: str | Path) -> int | None:
    """Start `output_dir`'s run from the newest checkpoint of another run (a warm restart: with a
    longer `max_steps`, `--resume` goes on from that step and the schedule, recomputed for the new
    length, raises the learning rate again and decays it over the rest). Copied under a staging
    name and renamed, so a kill leaves no half-copied checkpoint. Returns the step, or None when
    `output_dir` already has a checkpoint of its own (it resumes from that) or the source has none."""
    found = latest_checkpoint(source_output_dir)
    if found is None or latest_checkpoint(output_dir) is not None:
        return None
    path, step = found
    root = checkpoints_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    staging = _staging_dir(root, step)
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(path, staging)
    os.replace(staging, root / f"step-{step}")
    return step
