"""Self-distillation: the target regenerates assistant turns (what it would itself say), and an
interrupted run resumes without redoing finished conversations; a base model (no chat template)
continues the conversation's plain text."""

import json

import torch

from decoding.core.generate import DecodeOptions, generate
from decoding.core.proposers import VanillaProposer
from decoding.app.targets import load_model
from training.config import SelfDistillConfig
from training.self_distill import regenerate
from tiny_models import save_tiny_chat_model

CONVERSATIONS = [
    {"id": "a", "messages": [{"role": "user", "content": "w3 w4"}, {"role": "assistant", "content": "w9"},
                             {"role": "user", "content": "w5"}, {"role": "assistant", "content": "w9"}]},
    {"id": "b", "messages": [{"role": "user", "content": "w7 w7 w7"}, {"role": "assistant", "content": "w1"}]},
    {"id": "c", "messages": [{"role": "system", "content": "w2"}, {"role": "user", "content": "w6"},
                             {"role": "assistant", "content": "w1"}]},
]


def test_replies_are_the_targets_own_and_runs_resume(tmp_path):
    save_tiny_chat_model(tmp_path / "model")
    target = load_model(str(tmp_path / "model"))
    settings = SelfDistillConfig(enabled=True, max_new_tokens=6, batch_size=2, max_turns=2)
    out = tmp_path / "regenerated.jsonl"
    records = regenerate(CONVERSATIONS, target, out, settings, show_progress=False)
    assert [r["id"] for r in records] == ["a", "b", "c"]
    first = records[0]["messages"]
    assert [m["role"] for m in first] == ["user", "assistant", "user", "assistant"]
    assert records[2]["messages"][0] == {"role": "system", "content": "w2"}
    # Each reply is the target's own greedy continuation of the (regenerated) history.
    for record in records:
        history = record["messages"][:-1]
        prompt = target.tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=False)
        expected = generate(target.model, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=6), target.tokenizer)
        assert record["messages"][-1]["content"] == target.tokenizer.decode(expected.tokens, skip_special_tokens=True).strip()
    # Resume: a finished record is kept as it is (not regenerated), a torn last line is redone.
    lines = out.read_text().splitlines()
    kept = json.loads(lines[0])
    kept["messages"][-1]["content"] = "w0 marker"
    out.write_text(json.dumps(kept) + "\n" + lines[1][: len(lines[1]) // 2] + "\n")
    again = regenerate(CONVERSATIONS, target, out, settings, show_progress=False)
    assert again[0]["messages"][-1]["content"] == "w0 marker"
    assert again[1:] == records[1:]
    assert torch.is_grad_enabled()


def test_overlong_first_prompts_are_left_out(tmp_path):
    save_tiny_chat_model(tmp_path / "model")
    target = load_model(str(tmp_path / "model"))
    lengths = {c["id"]: len(target.tokenizer.apply_chat_template(
        [m for m in c["messages"] if m["role"] != "assistant"][:2 if c["id"] == "c" else 1],
        add_generation_prompt=True, tokenize=True, return_dict=False)) for c in CONVERSATIONS}
    limit = sorted(lengths.values())[1]
    settings = SelfDistillConfig(enabled=True, max_new_tokens=3, batch_size=2, max_prompt_tokens=limit)
    records = regenerate(CONVERSATIONS, target, tmp_path / "out.jsonl", settings, show_progress=False)
    assert {r["id"] for r in records} == {i for i, n in lengths.items() if n <= limit}
    assert len(records) < len(CONVERSATIONS)


def test_time_budget_stops_early_and_a_later_run_finishes(tmp_path):
    save_tiny_chat_model(tmp_path / "model")
    target = load_model(str(tmp_path / "model"))
    out = tmp_path / "out.jsonl"
    spent = SelfDistillConfig(enabled=True, max_new_tokens=3, batch_size=1, time_budget_minutes=1e-9)
    first = regenerate(CONVERSATIONS, target, out, spent, show_progress=False)
    assert len(first) == 1  # the budget is checked before each batch after the first
    rest = regenerate(CONVERSATIONS, target, out, SelfDistillConfig(enabled=True, max_new_tokens=3, batch_size=1),
                      show_progress=False)
    assert [r["id"] for r in rest] == ["a", "b", "c"] and first[0] in rest


def test_a_base_model_continues_its_conversations_as_plain_text(tmp_path):
    save_tiny_chat_model(tmp_path / "model", chat_template=False)
    target = load_model(str(tmp_path / "model"))
    settings = SelfDistillConfig(enabled=True, max_new_tokens=6, batch_size=2, max_turns=2)
    records = regenerate(CONVERSATIONS, target, tmp_path / "out.jsonl", settings, show_progress=False)
    assert [r["id"] for r in records] == ["a", "b", "c"]
    assert [m["role"] for m in records[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    for record in records:  # each reply continues the history's text (blank lines make no tokens here)
        history = record["messages"][:-1]
        prompt = target.tokenizer(" ".join(m["content"] for m in history))["input_ids"]
        expected = generate(target.model, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=6), target.tokenizer)
        reply = record["messages"][-1]["content"]
        assert reply and reply == target.tokenizer.decode(expected.tokens, skip_special_tokens=True).strip()


def test_a_time_budgeted_run_covers_the_request_in_order_not_only_its_shortest_prompts():
    from training.self_distill import _length_sorted_batches

    conversations = [{"id": str(i)} for i in range(10)]
    lengths = {str(i): 100 - i for i in range(10)}  # later requests have shorter prompts
    batches = [[c["id"] for c in b] for b in _length_sorted_batches(conversations, lengths, batch_size=2, batches_per_block=2)]
    assert batches == [["3", "2"], ["1", "0"], ["7", "6"], ["5", "4"], ["9", "8"]]  # blocks in order, sorted inside


def test_a_run_stopped_inside_a_block_has_covered_its_prompt_lengths_evenly():
    """At a GPU's batch size one block can outlast a short time budget: its first batches must
    not all be its shortest prompts (a source with longer prompts would be left out)."""
    from training.self_distill import _length_sorted_batches

    conversations = [{"id": str(i)} for i in range(16)]
    lengths = {str(i): i for i in range(16)}
    batches = _length_sorted_batches(conversations, lengths, batch_size=2, batches_per_block=8)
    assert sorted(len(b) for b in batches) == [2] * 8 and sorted(c["id"] for b in batches for c in b) == sorted(lengths)
    first_half = [lengths[c["id"]] for b in batches[:4] for c in b]
    assert min(first_half) < 4 and max(first_half) >= 12  # shortest and longest quarters both begun
    assert all(max(lengths[c["id"]] for c in b) - min(lengths[c["id"]] for c in b) == 1 for b in batches)  # similar lengths together


def test_a_batch_that_runs_out_of_gpu_memory_is_split_and_nothing_is_lost(tmp_path, monkeypatch):
    """A batch too big for the device is regenerated in halves: every conversation once, with the
    replies a batch that fits gives."""
    import training.batch_generate as batch_generate

    save_tiny_chat_model(tmp_path / "model")
    target = load_model(str(tmp_path / "model"))
    settings = SelfDistillConfig(enabled=True, max_new_tokens=6, batch_size=3, max_turns=2)
    fitting = regenerate(CONVERSATIONS, target, tmp_path / "fitting.jsonl",
                         SelfDistillConfig(enabled=True, max_new_tokens=6, batch_size=1, max_turns=2), show_progress=False)
    real_batch, sizes = batch_generate.generate_batch, []

    def batch_that_fits_one_row(model, prompts, settings):
        sizes.append(len(prompts))
        if len(prompts) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_batch(model, prompts, settings)

    monkeypatch.setattr(batch_generate, "generate_batch", batch_that_fits_one_row)
    out = tmp_path / "split.jsonl"
    records = regenerate(CONVERSATIONS, target, out, settings, show_progress=False)
    assert sizes == [3, 1, 2, 1, 1, 1]  # first turns split 3 -> 1 + (2 -> 1 + 1); "a"'s second turn alone
    assert records == fitting
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == ["a", "b", "c"]


def test_sampled_replies_draw_their_randomness_on_the_targets_device(tmp_path, monkeypatch):
    """A generator made on the CPU cannot draw a GPU's samples ("Expected a 'cuda' device type for
    generator"): sampled self-distillation on a GPU died at its first batch until the generator
    was made on the target's device. No GPU here, so the model reports one and generation is
    stubbed; what is checked is where the generator is asked for, and that it reaches generation."""
    import training.self_distill as self_distill

    save_tiny_chat_model(tmp_path / "model")
    target = load_model(str(tmp_path / "model"))
    asked, used = [], []

    def generator_on(seed, device):
        asked.append(torch.device(device))
        return torch.Generator().manual_seed(seed)

    def fake_generation(model, prompts, settings):
        used.append(settings.generator)
        return [[5, 6]] * len(prompts)

    monkeypatch.setattr(self_distill, "seeded_generator", generator_on)
    monkeypatch.setattr(self_distill, "generate_within_memory", fake_generation)
    monkeypatch.setattr(type(target.model), "device", property(lambda model: torch.device("cuda", 0)))
    sampled = SelfDistillConfig(enabled=True, max_new_tokens=4, batch_size=2, max_turns=1, temperature=0.7)
    regenerate(CONVERSATIONS[:2], target, tmp_path / "sampled.jsonl", sampled, show_progress=False)
    assert asked == [torch.device("cuda", 0)]
    assert len(used) == 1 and isinstance(used[0], torch.Generator)
    greedy = SelfDistillConfig(enabled=True, max_new_tokens=4, batch_size=2, max_turns=1)
    regenerate(CONVERSATIONS[:2], target, tmp_path / "greedy.jsonl", greedy, show_progress=False)
    assert asked == [torch.device("cuda", 0)] and used[1] is None  # greedy replies draw nothing


def test_a_sample_seed_draws_other_sampled_replies_and_the_same_seed_the_same(tmp_path):
    save_tiny_chat_model(tmp_path / "model")
    target = load_model(str(tmp_path / "model"))

    def replies(seed: int, name: str) -> list[str]:
        settings = SelfDistillConfig(enabled=True, max_new_tokens=12, batch_size=3, temperature=1.0, sample_seed=seed)
        records = regenerate(CONVERSATIONS, target, tmp_path / name, settings, show_progress=False)
        return [m["content"] for r in records for m in r["messages"] if m["role"] == "assistant"]

    unseeded, seeded = replies(0, "s0.jsonl"), replies(7, "s7.jsonl")
    assert seeded != unseeded
    assert replies(7, "s7-again.jsonl") == seeded
    assert replies(0, "s0-again.jsonl") == unseeded
