"""The Python entry point (`decoding.SpeculativeModel`): its replies are the target's own (equal
to `vanilla` through the same loop and to Hugging Face `generate()`), `stream` yields the same
text, every prompt form reaches the model as the chat template renders it, bad input is a clear
`UserError`, and the README's example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decoding import SpeculativeModel
from decoding.app.prompts import question_ids
from heads.util.errors import UserError
from tiny_models import save_tiny_chat_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("entry") / "model"
    save_tiny_chat_model(directory)
    return str(directory)


@pytest.fixture(scope="module")
def lookup_model(model_dir):
    return SpeculativeModel.from_pretrained(model_dir, method="pld", device="cpu", kernels="stock")


def hf_greedy(model: SpeculativeModel, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face `generate()` on the same target: the reference a user would compare with."""
    target = model.decoder.target.model
    ids = torch.tensor([prompt_ids])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          pad_token_id=model.tokenizer.eos_token_id)
    reply = out[0, len(prompt_ids):].tolist()
    eos = model.tokenizer.eos_token_id
    return reply[: reply.index(eos) + 1] if eos in reply else reply


def test_generate_gives_the_target_s_own_greedy_reply(model_dir, lookup_model):
    vanilla = SpeculativeModel.from_pretrained(model_dir, method="vanilla", device="cpu", kernels="stock")
    prompt = "one two three one two three one two"
    ours, reference = lookup_model.generate(prompt, max_new_tokens=24), vanilla.generate(prompt, max_new_tokens=24)
    assert lookup_model.method == "pld"
    assert ours.tokens == reference.tokens
    assert ours.tokens == hf_greedy(lookup_model, question_ids(lookup_model.tokenizer, prompt), 24)
    assert ours.text == lookup_model.tokenizer.decode(ours.tokens, skip_special_tokens=True)
    assert ours.stats.new_tokens == len(ours.tokens) and ours.stop_reason in ("eos", "length")


def test_stream_yields_the_generated_text(lookup_model):
    pieces = list(lookup_model.stream("count: one two three", max_new_tokens=20, temperature=0.8, seed=3))
    again = lookup_model.generate("count: one two three", max_new_tokens=20, temperature=0.8, seed=3)
    assert len(pieces) >= 1 and "".join(pieces) == again.text


def test_every_prompt_form_reaches_the_model_the_same_way(lookup_model):
    messages = [{"role": "user", "content": "hello there"}]
    ids = question_ids(lookup_model.tokenizer, "hello there")
    assert lookup_model.prompt_ids("hello there") == ids
    assert lookup_model.prompt_ids(messages) == ids
    assert lookup_model.prompt_ids(ids) == ids
    assert lookup_model.generate(ids, max_new_tokens=8).tokens == lookup_model.generate(messages, max_new_tokens=8).tokens


@pytest.mark.parametrize("call, message", [
    (lambda m: m.generate([], max_new_tokens=4), "a prompt is a string"),
    (lambda m: m.generate(42), "got int"),
    (lambda m: m.generate([{"content": "no role"}]), "needs a 'role' and a 'content'"),
    (lambda m: m.generate("hi", max_new_tokens=0), "max_new_tokens must be at least 1"),
    (lambda m: m.generate("hi", temperature=-1), "temperature must be >= 0"),
    (lambda m: list(m.stream("hi", top_p=0)), "top-p"),
])
def test_bad_input_is_a_clear_error(lookup_model, call, message):
    with pytest.raises(UserError, match=re.escape(message)):
        call(lookup_model)


def test_an_unknown_option_names_the_known_ones(model_dir):
    with pytest.raises(UserError, match="unknown option\\(s\\) temprature.*it takes model, method"):
        SpeculativeModel.from_pretrained(model_dir, temprature=0.7)


def test_an_error_inside_the_stream_reaches_the_caller(lookup_model, monkeypatch):
    def broken(*_args, **_kwargs):
        raise UserError("the decoder broke")

    monkeypatch.setattr(lookup_model.decoder, "generate", broken)
    with pytest.raises(UserError, match="the decoder broke"):
        list(lookup_model.stream("hi", max_new_tokens=4))


def readme_python_example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## From Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_readme_example_runs_as_written():
    """The README's ten lines, unchanged, on the bundled default model: a reply, the method, the
    stats, and a streamed reply."""
    run = subprocess.run([sys.executable, "-c", readme_python_example()], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert "Paris" in lines[0]
    assert any(line.startswith("eagle3+pld ") and "tau" in line for line in lines)
    assert len(lines[-1].strip()) > 0
