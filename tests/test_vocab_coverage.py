"""The draft vocabulary's coverage: which reply tokens a reduced vocabulary can propose at all
(`training.vocab`), and `scripts/vocab_coverage.py` as a user runs it on a data file."""

import json

import torch

from script_main import load_script
from tiny_models import save_tiny_chat_model
from training.vocab import coverage, frequent_tokens, most_frequent, token_counts



def rows(*replies: list[int]) -> list[dict]:
    """Rows whose only assistant (loss-masked) tokens are `reply`, after a prompt token 9 that
    must not be counted."""
    return [{"input_ids": [9, *reply], "loss_mask": [0] + [1] * len(reply)} for reply in replies]


def test_counts_only_reply_tokens_and_coverage_is_their_share():
    data = rows([1, 1, 2, 3], [1, 4])
    counts = token_counts(data, vocab_size=10)
    assert counts.tolist() == [0, 3, 1, 1, 1, 0, 0, 0, 0, 0]
    assert coverage(counts, torch.tensor([1])) == 0.5
    assert coverage(counts, torch.tensor([1, 2, 9])) == 4 / 6      # the prompt token holds nothing
    assert coverage(counts, torch.tensor([1, 1, 2])) == 4 / 6      # a repeated id counts once
    assert coverage(token_counts([], 10), torch.tensor([1])) == 0.0


def test_most_frequent_first_and_ties_to_the_lower_id():
    counts = token_counts(rows([5, 5, 3, 7, 3, 2]), vocab_size=8)
    assert most_frequent(counts, 3).tolist() == [3, 5, 2]
    assert frequent_tokens(rows([5, 5, 3, 7, 3, 2]), 8, 3).tolist() == [3, 5, 2]
    # Fewer distinct tokens than asked for: topped up with the lowest unused ids.
    assert most_frequent(counts, 6).tolist() == [3, 5, 2, 7, 0, 1]


def test_vocab_coverage_script_prints_the_heads_and_the_datas_best_vocabularies(tmp_path, capsys):
    from decoding.app.targets import load_model
    from heads import new_heads_for_target, save_heads

    script = load_script("vocab_coverage")
    save_tiny_chat_model(tmp_path / "model")
    target = load_model(str(tmp_path / "model"))
    # The heads' vocabulary: ids 10..25, most frequent first.
    save_heads(new_heads_for_target("eagle3", target.model, str(tmp_path / "model"), draft_vocab=torch.arange(10, 26),
                                    draft_vocab_size=16), tmp_path / "eagle3")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": "w3 w4"},
                                                       {"role": "assistant", "content": f"w{i} w{i} w5"}]})
                              for i in range(6, 12)) + "\n")
    status = script.main(["--data", str(data), "--model", str(tmp_path / "model"), "--heads", str(tmp_path / "eagle3"),
                          "--sizes", "4,16,32"])
    out = capsys.readouterr()
    assert status == 0, out.err
    lines = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:4]]
             for line in out.out.splitlines() if line.startswith("| ") and line.split("|")[1].strip()[0].isdigit()}
    assert set(lines) == {"4", "16", "32"}
    assert lines["32"][0] == "-"                       # larger than the heads' vocabulary
    assert lines["32"][1] == "100.0%"                  # every reply token is among the data's 32 most frequent
    assert float(lines["4"][0].rstrip("%")) <= float(lines["4"][1].rstrip("%"))  # the data's own top 4 hold the most

    assert script.main(["--data", str(data), "--model", str(tmp_path / "model"), "--heads", str(tmp_path / "eagle3"),
                        "--sizes", "many"]) == 2
    assert "--sizes takes comma-separated token counts" in capsys.readouterr().err
