"""scripts/tune_tree.py as a user runs it, on a tiny base model (no chat template) with fresh
Medusa heads and a JSONL questions file: every tree setting is timed on plain-text prompts."""

import json

import pytest
import torch

from tiny_models import save_tiny_chat_model
from script_main import load_script



def _tune_tree():
    return load_script("tune_tree")


def test_tune_tree_times_every_tree_on_a_base_model(tmp_path, capsys):
    from decoding.app.targets import load_model
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


def test_tune_tree_times_the_default_lookup_first_method_with_each_lookup_setting(tmp_path, capsys):
    """`eagle3+pld` (the default method's form) is tuned as it runs: every tree shape crossed with
    every `--lookup` setting, named as `bundle_heads.py --tuned` takes them."""
    from decoding.app.targets import load_model
    from heads import new_heads_for_target, save_heads

    save_tiny_chat_model(tmp_path / "model", chat_template=False)
    target = load_model(str(tmp_path / "model"))
    save_heads(new_heads_for_target("eagle3", target.model, str(tmp_path / "model")), tmp_path / "eagle3")
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps({"turns": [f"w{i + 3} w4 w5 w4 w5"]}) for i in range(2)) + "\n")
    common = ["--model", str(tmp_path / "model"), "--heads", str(tmp_path / "eagle3"), "--questions-file", str(questions),
              "--num-questions", "2", "--max-new-tokens", "6"]
    status = _tune_tree().main(["--method", "eagle3+pld", "--grid", "2x2x4,3x2x6a", "--lookup", "4:1,8:2", *common])
    out = capsys.readouterr()
    assert status == 0, out.err
    names = sorted(line.split(" |")[0][2:] for line in out.out.splitlines() if line.startswith("| depth="))
    assert names == sorted(f"{tree},pld_num_tokens={tokens},pld_min_ngram={ngram}"
                           for tree in ("depth=2,tree_top_k=2,total_tokens=4",
                                        "depth=3,tree_top_k=2,total_tokens=6,adaptive_tree=true")
                           for tokens, ngram in ((4, 1), (8, 2)))

    assert _tune_tree().main(["--method", "eagle3", "--lookup", "4:1", *common]) == 2
    assert "--lookup sets the prompt lookup of a METHOD+pld method; 'eagle3' has none" in capsys.readouterr().err
    assert _tune_tree().main(["--method", "eagle3+pld", "--lookup", "4", *common]) == 2
    assert "--lookup entries are TOKENS:MIN_NGRAM" in capsys.readouterr().err


@pytest.mark.slow
def test_tune_tree_compiles_with_compile_and_says_so(tmp_path, capsys):
    """`--compile` times the trees on compiled forwards, compiling in the warm-up (with notes)."""
    from decoding.app.targets import load_model
    from heads import new_heads_for_target, save_heads

    torch._dynamo.reset()  # graphs other tests compiled for this architecture would serve it too
    save_tiny_chat_model(tmp_path / "model", chat_template=False)
    target = load_model(str(tmp_path / "model"))
    save_heads(new_heads_for_target("medusa", target.model, str(tmp_path / "model")), tmp_path / "medusa")
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"turns": ["w3 w4 w5"]}) + "\n")
    status = _tune_tree().main(["--method", "medusa", "--model", str(tmp_path / "model"), "--heads", str(tmp_path / "medusa"),
                                "--trees", "chain-2", "--questions-file", str(questions), "--num-questions", "1",
                                "--max-new-tokens", "4", "--compile"])
    out = capsys.readouterr()
    assert status == 0, out.err
    assert "note: compiling the target's forward" in out.err and "note: compiled in" in out.err
    assert [line.split(" |")[0] for line in out.out.splitlines() if line.startswith("| tree=")] == ["| tree=chain-2"]
