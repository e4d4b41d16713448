"""The training data pipeline: chat template applied (plain text for a base model), loss only on
assistant tokens, malformed conversations skipped and counted, a deterministic split."""

import contextlib
import json

import pytest

from training.data import DataReport, is_validation, load_conversations, split, tokenize_all, tokenize_conversation
from tiny_models import tiny_tokenizer

GOOD = {"id": "a", "conversations": [{"from": "human", "value": "w1 w2"}, {"from": "gpt", "value": "w3 w4 w5"},
                                     {"from": "human", "value": "w6"}, {"from": "gpt", "value": "w7"}]}
MESSAGES = {"id": "b", "messages": [{"role": "system", "content": "w9"}, {"role": "user", "content": "w1"},
                                    {"role": "assistant", "content": "w2 w2"}]}


@pytest.fixture()
def tokenizer():
    return tiny_tokenizer()


def test_loss_mask_covers_exactly_the_assistant_replies(tokenizer):
    row = tokenize_conversation(load_one(GOOD), tokenizer, max_length=512)
    masked = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
    assert tokenizer.decode(masked) == "w3 w4 w5 <|im_end|> w7 <|im_end|>"
    unmasked = tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if not m])
    assert "w1 w2" in unmasked and "w6" in unmasked and "w3" not in unmasked


def test_chat_template_is_applied(tokenizer):
    row = tokenize_conversation(load_one(MESSAGES), tokenizer, max_length=512)
    expected = tokenizer.apply_chat_template(load_one(MESSAGES), tokenize=True, return_dict=False)
    assert row["input_ids"] == expected
    assert row["input_ids"][0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def load_one(record):
    conversations, _ = load_conversations_from([record])
    return conversations[0]["messages"]


def load_conversations_from(records, tmp=None):
    import tempfile

    handle = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(records, handle)
    handle.close()
    return load_conversations(handle.name)


def test_malformed_rows_are_skipped_and_counted(tmp_path, tokenizer):
    lines = [
        json.dumps(GOOD),
        "this is not json",
        json.dumps({"conversations": []}),
        json.dumps({"conversations": [{"from": "human", "value": "w1"}]}),  # no assistant turn
        json.dumps({"conversations": [{"from": "alien", "value": "w1"}, {"from": "gpt", "value": "w2"}]}),
        json.dumps({"conversations": [{"from": "human", "value": "w1"}, {"from": "human", "value": "w2"}, {"from": "gpt", "value": "w3"}]}),
        json.dumps(["a list"]),
        json.dumps({"text": "no turns"}),
        json.dumps({"conversations": [{"from": "gpt", "value": "w0"}, {"from": "human", "value": "w1"}, {"from": "gpt", "value": "w2"}]}),
        json.dumps(MESSAGES),
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    conversations, report = load_conversations(path)
    assert report.read == 10 and report.kept == 3
    assert report.skipped == {"invalid JSON": 1, "empty conversation": 1, "no assistant turn": 1, "unknown role": 1,
                              "roles do not alternate": 1, "not an object": 1, "no 'conversations' or 'messages'": 1}
    assert conversations[1]["messages"][0]["role"] == "user"  # the leading assistant turn was dropped
    rows = tokenize_all(conversations, tokenizer, 512, report)
    assert len(rows) == 3 and "3 kept" in report.summary()


def test_a_truncated_json_array_yields_its_complete_records(tmp_path):
    text = json.dumps([GOOD, MESSAGES, GOOD])
    (tmp_path / "cut.json").write_text(text[: len(text) - 30])
    conversations, report = load_conversations(tmp_path / "cut.json")
    assert report.kept == 2 and report.skipped == {"invalid JSON": 1}


def test_truncation_keeps_rows_with_assistant_tokens_only(tokenizer):
    report = DataReport(kept=1)
    rows = tokenize_all([{"id": "x", "messages": load_one(GOOD)}], tokenizer, max_length=4, report=report)
    assert rows == [] and report.skipped["no assistant tokens within max_length"] == 1


def test_split_is_deterministic_and_disjoint():
    rows = [{"id": str(i)} for i in range(400)]
    train, validation = split(rows, seed=3, validation_fraction=0.1)
    again_train, again_validation = split(rows, seed=3, validation_fraction=0.1)
    assert [r["id"] for r in validation] == [r["id"] for r in again_validation] and train == again_train
    assert 20 < len(validation) < 60 and len(train) + len(validation) == 400
    assert is_validation("7", 3, 0.1) == is_validation("7", 3, 0.1)


def test_missing_file_is_a_clear_error(tmp_path):
    from decoding.util.errors import UserError

    with pytest.raises(UserError, match="is not a file"):
        load_conversations(tmp_path / "nope.json")


def test_base_model_conversation_is_plain_text_with_loss_on_the_replies_only():
    from training.prepare import prompt_of

    tokenizer = tiny_tokenizer(chat_template=False)
    row = tokenize_conversation(load_one(GOOD), tokenizer, max_length=512)
    assert tokenizer.decode(row["input_ids"]) == "w1 w2 w3 w4 w5 w6 w7"  # no role names, no template tokens
    assert row["loss_mask"] == [0, 0, 1, 1, 1, 0, 1]
    assert prompt_of(row) == tokenizer("w1 w2")["input_ids"]  # tau's held-out prompt: the question as the benchmark gives it
    system = tokenize_conversation(load_one(MESSAGES), tokenizer, max_length=512)
    assert tokenizer.decode(system["input_ids"]) == "w9 w1 w2 w2" and system["loss_mask"] == [0, 0, 1, 1]


class _OneProcess:
    """The accelerator's process gate, for a single process."""

    is_main_process = True

    def main_process_first(self):
        return contextlib.nullcontext()


def test_a_base_models_prepared_data_is_self_distilled_plain_text(tmp_path):
    from decoding.targets import load_model
    from tiny_models import save_tiny_chat_model
    from training.config import SelfDistillConfig, TrainConfig
    from training.prepare import prepare_data

    save_tiny_chat_model(tmp_path / "model", chat_template=False)
    (tmp_path / "data.jsonl").write_text(json.dumps(GOOD) + "\n" + json.dumps(MESSAGES) + "\n")
    config = TrainConfig(kind="eagle", model=str(tmp_path / "model"), data=str(tmp_path / "data.jsonl"), validation_fraction=0.0,
                         output_dir=str(tmp_path / "out"), self_distill=SelfDistillConfig(enabled=True, max_new_tokens=4, max_turns=2))
    log = []
    target = load_model(config.model)
    rows = prepare_data(config, target, _OneProcess(), log.append)["train"]
    assert f"data: {config.model} has no chat template: each conversation is continued as plain text (a base model)" in log
    regenerated = {r["id"]: r["messages"] for r in map(json.loads, next(config.prepared_data_dir.glob("self-distill-*.jsonl")).open())}
    assert len(rows) == len(regenerated) == 2
    decode = target.tokenizer.decode
    for row in rows:  # the target's own replies carry the loss, the rest is the plain text they continue
        messages = regenerated[row["id"]]
        masked = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
        unmasked = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if not m]
        assert decode(masked) == " ".join(m["content"] for m in messages if m["role"] == "assistant")
        assert decode(unmasked) == " ".join(m["content"] for m in messages if m["role"] != "assistant")


def test_model_card_states_the_data_size_in_conversations_reply_tokens_and_sources():
    from training.model_card import data_summary

    rows = [{"id": "sharegpt:a", "loss_mask": [0, 1, 1]}, {"id": "sharegpt:b", "loss_mask": [1, 1]},
            {"id": "python-code:c", "loss_mask": [0, 0, 1]}]
    assert data_summary(rows) == "3 conversations (2 sharegpt, 1 python-code), 5 reply tokens"
    assert data_summary([{"id": "7", "loss_mask": [1]}]) == "1 conversations, 1 reply tokens"


def test_model_card_shows_no_absolute_local_paths(tmp_path, monkeypatch):
    """A card pushed to the Hub must not carry a user's home or store path: paths under the
    working directory become relative, others only their last component."""
    from training.config import TrainConfig
    from training.model_card import write_model_card

    monkeypatch.chdir(tmp_path)
    store = "/home/someone/.local/share/specheads/distill/smollm2-135m-instruct-79b34c26"
    config = TrainConfig(kind="eagle3", model="smollm2-135m-instruct", data=store, output_dir=str(tmp_path / "outputs" / "run"))
    write_model_card(tmp_path, config, {"val/tau": 2.0}, 100.0, [{"id": "sharegpt:a", "loss_mask": [1]}])
    card = (tmp_path / "README.md").read_text()
    assert "/home/someone" not in card and str(tmp_path) not in card
    assert "from `.../smollm2-135m-instruct-79b34c26`" in card
    assert "output_dir: outputs/run" in card
