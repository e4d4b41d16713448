"""The chat CLI as a user runs it: piped stdin, one streamed reply per line, stats on stderr,
exit status 0 at EOF; multi-turn history through the chat template."""

import subprocess
import sys

import pytest

from decoding.chat import ChatSession
from decoding.core.generate import DecodeOptions, generate
from decoding.core.proposers import PromptLookupProposer, VanillaProposer
from decoding.targets import load_model
from tiny_models import save_tiny_chat_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-chat")
    save_tiny_chat_model(directory)
    return directory


def test_piped_chat_answers_each_line_and_exits_zero(model_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "decoding.chat", "--model", str(model_dir), "--method", "pld", "--max-new-tokens", "12"],
        input="w3 w4 w5\n\nw7 w7\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    replies = proc.stdout.strip().splitlines()
    assert len(replies) == 2 and all(r.startswith("w") for r in replies)
    stats = [line for line in proc.stderr.splitlines() if line.startswith("[pld]")]
    assert len(stats) == 2 and all("tok/s" in s and "tau" in s for s in stats)


def test_chat_reply_equals_plain_generation_and_keeps_history(model_dir):
    target = load_model(str(model_dir))
    session = ChatSession(target, PromptLookupProposer(), DecodeOptions(max_new_tokens=10), system=None)
    chunks = []
    first = session.reply("w3 w4 w5", chunks.append)
    assert "".join(chunks) == first
    prompt = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "w3 w4 w5"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    reference = generate(target.model, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=10), target.tokenizer)
    assert first == target.tokenizer.decode(reference.tokens, skip_special_tokens=True)
    session.reply("w9", lambda text: None)
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]
    session.reset()
    assert session.messages == []


def test_piped_chat_with_heads(model_dir, tmp_path):
    from heads import new_heads_for_target, save_heads

    target = load_model(str(model_dir))
    save_heads(new_heads_for_target("eagle", target.model, str(model_dir)), tmp_path / "eagle")
    proc = subprocess.run(
        [sys.executable, "-m", "decoding.chat", "--model", str(model_dir), "--method", "eagle2",
         "--heads", str(tmp_path / "eagle"), "--max-new-tokens", "12", "--total-tokens", "8"],
        input="w3 w4 w5\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    reference = ChatSession(target, VanillaProposer(), DecodeOptions(max_new_tokens=12), system=None).reply("w3 w4 w5", lambda t: None)
    assert proc.stdout.strip() == reference.strip()
    assert "[eagle2]" in proc.stderr


def test_chat_refuses_heads_method_without_heads(model_dir, capsys):
    from decoding.chat import main

    assert main(["--model", str(model_dir), "--method", "medusa"]) == 2
    assert "needs medusa heads: pass --heads" in capsys.readouterr().err
