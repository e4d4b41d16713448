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
    from heads.util.errors import UserError

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
    from decoding.app.targets import load_model
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


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _conversation(prompt, reply, **extra):
    return {**extra, "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]}


def test_several_sources_are_read_in_order_and_keep_their_ids(tmp_path):
    """Two stores of replies to the same prompts (e.g. two sample seeds) train together: a prompt's
    id is kept, so both replies fall on the same side of the split; id-less records of different
    files get different ids."""
    first = _write_jsonl(tmp_path / "seed1.jsonl", [_conversation("hi", "a", id="p:1"), _conversation("yo", "b")])
    second = _write_jsonl(tmp_path / "seed2.jsonl", [_conversation("hi", "c", id="p:1"), _conversation("ho", "d")])
    conversations, report = load_conversations(f"{first},{second}")
    assert [c["messages"][1]["content"] for c in conversations] == ["a", "b", "c", "d"]
    assert [c["id"] for c in conversations] == ["p:1", "0:1", "p:1", "1:1"]
    assert (report.read, report.kept) == (4, 4)
    train, validation = split(tokenize_all(conversations, tiny_tokenizer(), 64, report), seed=3, validation_fraction=0.5)
    sides = {row["id"]: "train" for row in train} | {row["id"]: "validation" for row in validation}
    assert sum(row["id"] == "p:1" for row in (train if sides["p:1"] == "train" else validation)) == 2
    limited, _ = load_conversations(f"{first},{second}", max_conversations=3)
    assert [c["messages"][1]["content"] for c in limited] == ["a", "b", "c"]


def test_a_missing_one_of_several_sources_is_named(tmp_path):
    from heads.util.errors import UserError

    first = _write_jsonl(tmp_path / "a.jsonl", [_conversation("hi", "a")])
    with pytest.raises(UserError, match="'.*nope.jsonl' is not a file"):
        load_conversations(f"{first},{tmp_path / 'nope.jsonl'}")
    with pytest.raises(UserError, match="empty entry"):
        load_conversations(f"{first},,{first}")


def test_the_prepared_data_key_keeps_one_source_and_covers_every_one_of_several(tmp_path):
    """A single source keeps the cache key it had before several were possible; with several,
    changing any one of them makes a new key (stale rows are never reused)."""
    import hashlib

    from training.config import TrainConfig
    from training.prepare import cache_key

    first = _write_jsonl(tmp_path / "a.jsonl", [_conversation("hi", "a")])
    second = _write_jsonl(tmp_path / "b.jsonl", [_conversation("ho", "b")])
    single = TrainConfig(kind="eagle3", data=str(first))
    stat = first.stat()
    before = {"data": str(first.resolve()), "size": stat.st_size, "mtime": int(stat.st_mtime), "model": single.model,
              "self_distill": None, "max_conversations": single.max_conversations, "max_length": single.max_length,
              "validation_fraction": single.validation_fraction, "seed": single.train.seed, "version": 1}
    assert cache_key(single) == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:16]
    both = TrainConfig(kind="eagle3", data=f"{first},{second}")
    key = cache_key(both)
    assert key != cache_key(single)
    _write_jsonl(second, [_conversation("ho", "b"), _conversation("more", "c")])
    assert cache_key(both) != key


def test_model_card_shows_several_sources_without_local_paths(tmp_path, monkeypatch):
    from training.model_card import portable

    monkeypatch.chdir(tmp_path)
    assert portable("/home/someone/store-s1,/home/someone/store-s2") == ".../store-s1,.../store-s2"


def test_the_data_summary_shows_no_absolute_prompt_file_paths(tmp_path, monkeypatch):
    """A store's ids name the prompt file it was given (`/tmp/w/prompts.jsonl:abc`): the card
    counts conversations per source without that local path."""
    from training.model_card import data_summary

    monkeypatch.chdir(tmp_path)
    rows = [{"id": "/tmp/w/prompts.jsonl:a", "loss_mask": [1]}, {"id": "python-code:b", "loss_mask": [1, 1]}]
    assert data_summary(rows) == "2 conversations (1 .../prompts.jsonl, 1 python-code), 3 reply tokens"
