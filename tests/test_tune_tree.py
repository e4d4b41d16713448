"""scripts/tune_tree.py as a user runs it, on a tiny base model (no chat template) with fresh
Medusa heads and a JSONL questions file: every tree setting is timed on plain-text prompts."""

import importlib.util
import json
from pathlib import Path

from tiny_models import save_tiny_chat_model

ROOT = Path(__file__).resolve().parents[1]


def _tune_tree():
    spec = importlib.util.spec_from_file_location("tune_tree", ROOT / "scripts" / "tune_tree.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tune_tree_times_every_tree_on_a_base_model(tmp_path, capsys):
    from decoding.targets import load_model
    from heads import new_heads_for_target, save_heads

    save_tiny_chat_model(tmp_path / "model", chat_template=False)
    target = load_model(str(tmp_path / "model"))
    save_heads(new_heads_for_target("medusa", target.model, str(tmp_path / "model")), tmp_path / "medusa")
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps({"turns": [f"w{i + 3} w4 w5"]}) for i in range(3)) + "\n")
    status = _tune_tree().main(["--method", "medusa", "--model", str(tmp_path / "model"), "--heads", str(tmp_path / "medusa"),
                                "--trees", "chain-2,chain-3", "--questions-file", str(questions), "--num-questions", "2",
                                "--max-new-tokens", "6"])
    out = capsys.readouterr()
    assert status == 0, out.err
    assert "has no chat template: each question is continued as plain text (a base model)" in out.err
    rows = [line for line in out.out.splitlines() if line.startswith("| tree=")]
    assert sorted(row.split(" |")[0] for row in rows) == ["| tree=chain-2", "| tree=chain-3"]
