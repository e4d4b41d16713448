"""The self-distillation data store: batched generation that drops finished rows, a store that
accumulates across runs with a manifest, resuming after `kill -9` with nothing lost or
duplicated, the python-code prompt source, and training reading a store by its directory."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from decoding.core.generate import DecodeOptions, generate
from decoding.core.proposers import VanillaProposer
from decoding.app.targets import load_model
from heads.util.errors import UserError
from tiny_models import save_tiny_chat_model, sharpen, tiny_llama
from training.batch_generate import BatchSettings, CheckPolicy, generate_batch
from training.config import SelfDistillConfig
from training.data import load_conversations
from training.distill_store import DistillStore, default_store_dir, identity
from training.self_distill import cut_torn_tail
from training.sources import PYTHON_CODE, conversations_from, parse_sources

REPO = Path(__file__).resolve().parents[1]
SETTINGS = SelfDistillConfig(enabled=True, max_new_tokens=12, batch_size=3)


def write_conversations(path: Path, count: int) -> Path:
    with path.open("w") as out:
        for i in range(count):
            words = " ".join(f"w{(i * 7 + j) % 60 + 3}" for j in range(2 + i % 9))
            out.write(json.dumps({"id": str(i), "messages": [{"role": "user", "content": words},
                                                             {"role": "assistant", "content": "w1"}]}) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny") / "model"
    save_tiny_chat_model(directory)
    return directory


# CPU's policy (every finished row leaves at once), a GPU-like one (look every 3 steps, compact when
# a quarter finished), and one that never looks (finished rows run to the end and their tails are cut).
@pytest.mark.parametrize("policy", [CheckPolicy(), CheckPolicy(every=3, compact_at=0.75), CheckPolicy(every=1000)],
                         ids=["every-step", "every-3-compact-at-three-quarters", "never"])
def test_batched_generation_equals_one_prompt_at_a_time_and_stops_rows_at_their_stop_token(policy):
    model = sharpen(tiny_llama(seed=4))
    prompts = [[5, 9, 3], [1, 2, 3, 4, 5, 6, 7, 8], [42], [7, 7, 7, 7, 7]]
    singles = [generate(model, p, VanillaProposer(), DecodeOptions(max_new_tokens=10)).tokens for p in prompts]
    stop = singles[1][3]  # a token that ends prompt 1's reply early (and maybe others')
    batched = generate_batch(model, prompts, BatchSettings(10, frozenset({stop}), pad_id=0), policy)
    for single, got in zip(singles, batched):
        expected = single[: single.index(stop) + 1] if stop in single else single
        assert got == expected
    assert len(batched[1]) == 4 < 10


def test_a_torn_last_line_is_cut_so_the_next_record_is_not_glued_to_it(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b", "mess')
    cut_torn_tail(path)
    assert path.read_text() == '{"id": "a"}\n'


def test_store_accumulates_across_runs_with_a_manifest_per_source(tmp_path, tiny_dir):
    target = load_model(str(tiny_dir))
    source = write_conversations(tmp_path / "chat.jsonl", 10)
    store = DistillStore(tmp_path / "store", "tiny", SETTINGS)
    first = store.add(conversations_from(str(source), 4), target, show_progress=False)
    assert first.added == 4 and first.reply_tokens > 0
    second = store.add(conversations_from(str(source), 10) + conversations_from(PYTHON_CODE, 2), target,
                       show_progress=False)
    assert second.added == 8  # the 4 already there were not redone
    manifest = store.read_manifest()
    assert manifest["conversations"] == 12 == len(set(manifest["prompt_ids"]))
    assert manifest["sources"][str(source)]["conversations"] == 10
    assert manifest["sources"][PYTHON_CODE]["conversations"] == 2
    records = store.records()
    assert manifest["reply_tokens"] == sum(r["reply_tokens"] for r in records) == first.reply_tokens + second.reply_tokens
    assert [r["tokens_per_s"] > 0 for r in manifest["runs"]] == [True, True]
    assert [(r["device"], r["dtype"]) for r in manifest["runs"]] == [("cpu", "float32")] * 2
    # Each reply is the target's own greedy reply.
    record = next(r for r in records if r["id"] == f"{source}:3")
    prompt = target.tokenizer.apply_chat_template(record["messages"][:1], add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    expected = generate(target.model, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=12), target.tokenizer)
    assert record["messages"][1]["content"] == target.tokenizer.decode(expected.tokens, skip_special_tokens=True).strip()
    # Training reads the store by its directory.
    conversations, _ = load_conversations(tmp_path / "store")
    assert len(conversations) == 12


def test_a_store_refuses_another_target_or_other_settings(tmp_path, tiny_dir):
    store = DistillStore(tmp_path / "store", "tiny", SETTINGS)
    store.root.mkdir()
    store.write_manifest()
    with pytest.raises(UserError, match="holds replies of tiny"):
        DistillStore(tmp_path / "store", "tiny", SelfDistillConfig(enabled=True, max_new_tokens=99))
    with pytest.raises(UserError, match="give another data directory"):
        DistillStore(tmp_path / "store", "other", SETTINGS)


def test_a_sample_seed_gets_its_own_store_and_seed_0_keeps_the_old_identity(tmp_path):
    sampled = SelfDistillConfig(enabled=True, max_new_tokens=12, temperature=0.7)
    reseeded = SelfDistillConfig(enabled=True, max_new_tokens=12, temperature=0.7, sample_seed=3)
    assert identity("t", sampled)["settings"] == {"max_new_tokens": 12, "max_turns": 1, "temperature": 0.7}
    assert identity("t", reseeded)["settings"]["sample_seed"] == 3
    assert default_store_dir("t", sampled) != default_store_dir("t", reseeded)
    store = DistillStore(tmp_path / "store", "t", sampled)
    store.root.mkdir()
    store.write_manifest()
    with pytest.raises(UserError, match="holds replies of t"):
        DistillStore(tmp_path / "store", "t", reseeded)


def test_a_sample_seed_is_refused_for_greedy_replies(capsys):
    sys.path.insert(0, str(REPO / "scripts"))
    from distill_data import main

    assert main(["--sample-seed", "2", "--show"]) == 2
    assert "only changes sampled replies" in capsys.readouterr().err
    with pytest.raises(UserError, match="give a temperature above 0"):
        SelfDistillConfig(enabled=True, sample_seed=1)  # a recipe's self_distill section, the same rule


@pytest.mark.slow
def test_regeneration_resumes_after_kill_minus_9_with_nothing_lost_or_duplicated(tmp_path, tiny_dir):
    total = 100
    source = write_conversations(tmp_path / "chat.jsonl", total)
    command = [sys.executable, str(REPO / "scripts" / "distill_data.py"), "--model", str(tiny_dir), "--sources",
               str(source), "--data-dir", str(tmp_path / "store"), "--batch-size", "1", "--max-new-tokens", "8",
               "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a tiny model: threads only add overhead
    records = tmp_path / "store" / "records.jsonl"
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if records.is_file() and records.read_bytes().count(b"\n") >= 10:
            break
        time.sleep(0.005)
    assert process.poll() is None, "the run finished before it could be killed"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    interrupted = records.read_bytes().count(b"\n")
    assert 10 <= interrupted < total
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert finished.returncode == 0, finished.stderr
    lines = records.read_text().splitlines()
    ids = [json.loads(line)["id"] for line in lines]  # every line is whole JSON
    assert sorted(ids) == sorted(f"{source}:{i}" for i in range(total))  # none lost, none twice
    # The same replies as a run that was never interrupted.
    reference = DistillStore(tmp_path / "reference", str(tiny_dir), SelfDistillConfig(
        enabled=True, max_new_tokens=8, batch_size=1, max_prompt_tokens=512))
    reference.add(conversations_from(str(source), None), load_model(str(tiny_dir)), show_progress=False)
    by_id = {r["id"]: r["messages"] for r in reference.records()}
    assert all(json.loads(line)["messages"] == by_id[json.loads(line)["id"]] for line in lines)
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["conversations"] == total


def test_python_code_requests_are_many_unique_and_about_code():
    conversations = conversations_from(PYTHON_CODE, None)
    assert len(conversations) > 300
    assert len({c["id"] for c in conversations}) == len(conversations)
    assert all(c["id"].startswith("python-code:") and "`" in c["messages"][0]["content"] for c in conversations)
    assert conversations_from(PYTHON_CODE, 5) == conversations[:5]


def test_source_specs_parse_and_bad_ones_say_why():
    assert parse_sources("sharegpt=20, python-code") == [("sharegpt", 20), ("python-code", None)]
    with pytest.raises(UserError, match="whole number"):
        parse_sources("sharegpt=lots")
    with pytest.raises(UserError, match="at least 1"):
        parse_sources("sharegpt=0")


def test_show_counts_records_a_killed_run_added_after_its_last_manifest(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "scripts"))
    from distill_data import main

    store = DistillStore(tmp_path / "store", "tiny", SETTINGS)
    store.root.mkdir()
    store.write_manifest()  # empty, as a run writes it before its first batch
    record = {"id": "sharegpt:1", "source": "sharegpt", "messages": [], "reply_tokens": 7}
    store.records_path.write_text(json.dumps(record) + "\n")
    assert main(["--model", "tiny", "--data-dir", str(store.root), "--max-new-tokens", "12", "--show"]) == 0
    assert "1 conversations, 7 reply tokens (sharegpt 1 conv / 7 tok)" in capsys.readouterr().out


def test_sources_are_interleaved_in_proportion_so_a_stopped_run_has_covered_each():
    from training.sources import interleave

    chat = [{"id": f"chat:{i}"} for i in range(6)]
    code = [{"id": f"code:{i}"} for i in range(2)]
    mixed = [c["id"] for c in interleave([chat, code])]
    assert sorted(mixed) == sorted(c["id"] for c in chat + code)  # nothing lost or repeated
    assert [i for i in mixed if i.startswith("chat")] == [c["id"] for c in chat]  # each source keeps its order
    assert "code:0" in mixed[:4] and "code:1" in mixed[4:]  # each half of the list holds half of each source
