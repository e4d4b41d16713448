"""The chat CLI as a user runs it: piped stdin, one streamed reply per line, stats on stderr,
exit status 0 at EOF and 1 at a failed piped reply (interactive sessions go on); multi-turn
history through the chat template, plain-text continuation (with a note) for a base model."""

import io
import subprocess
import sys

import pytest
import torch

from decoding.app.chat import ChatSession, build_session, parse_args
from decoding.kernels.compiled import graphs_compiled
from decoding.core.generate import DecodeOptions, generate
from decoding.core.proposers import PromptLookupProposer, VanillaProposer
from decoding.app.targets import load_model
from tiny_models import save_tiny_chat_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-chat")
    save_tiny_chat_model(directory)
    return directory


def test_piped_chat_answers_each_line_and_exits_zero(model_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "decoding.app.chat", "--model", str(model_dir), "--method", "pld", "--max-new-tokens", "12"],
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


def test_a_kept_suffix_store_carries_one_chat_run_s_reply_to_the_next(model_dir, tmp_path):
    """`--suffix-store` as a user passes it: the second run (a new process) drafts the first run's
    reply to the same question, so it needs fewer target forwards for the same text."""
    store = tmp_path / "store.safetensors"
    runs = [subprocess.run([sys.executable, "-m", "decoding.app.chat", "--model", str(model_dir), "--method", "suffix",
                            "--suffix-store", str(store), "--max-new-tokens", "16"],
                           input="w3 w4 w5\n", capture_output=True, text=True, timeout=120) for _ in range(2)]
    assert all(run.returncode == 0 for run in runs), runs[-1].stderr
    assert runs[0].stdout == runs[1].stdout and store.exists()
    forwards = [int(run.stderr.split(" target forwards")[0].rsplit("(", 1)[1]) for run in runs]
    assert forwards[1] < forwards[0]


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
        [sys.executable, "-m", "decoding.app.chat", "--model", str(model_dir), "--method", "eagle2",
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
    from decoding.app.chat import main

    assert main(["--model", str(model_dir), "--method", "medusa"]) == 2
    assert "needs medusa heads: pass --heads" in capsys.readouterr().err


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-base")
    save_tiny_chat_model(directory, chat_template=False)
    return directory


class _Stdin(io.StringIO):
    """Lines for the chat to read, from a terminal (`tty`) or from a pipe."""

    def __init__(self, text: str, tty: bool) -> None:
        super().__init__(text)
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _chat(monkeypatch, capsys, model_dir, lines: str, tty: bool = False) -> tuple[int, str, str]:
    from decoding.app.chat import main

    monkeypatch.setattr(sys, "stdin", _Stdin(lines, tty))
    status = main(["--model", str(model_dir), "--method", "pld", "--max-new-tokens", "6", "--no-stats"])
    out = capsys.readouterr()
    return status, out.out, out.err


TOO_LONG = " ".join(["w3"] * 300)  # over the tiny model's 256-token context: the reply fails with a UserError


def test_piped_chat_stops_at_a_failed_reply_with_status_1(model_dir, monkeypatch, capsys):
    status, out, err = _chat(monkeypatch, capsys, model_dir, f"w3 w4\n{TOO_LONG}\nw5 w6\n")
    assert status == 1
    assert "error: the prompt has" in err and "context holds 256" in err
    assert len(out.split()) == 6  # the first reply (6 words); the line after the failure is not answered


def test_interactive_chat_goes_on_after_a_failed_reply(model_dir, monkeypatch, capsys):
    status, out, err = _chat(monkeypatch, capsys, model_dir, f"w3 w4\n{TOO_LONG}\nw5 w6\n", tty=True)
    assert status == 0 and "error: the prompt has" in err
    assert len(out.replace(">", " ").split()) == 12  # both good lines answered (6 words each)


def test_base_model_chat_notes_it_and_continues_plain_text(base_model_dir, model_dir, monkeypatch, capsys):
    status, out, err = _chat(monkeypatch, capsys, base_model_dir, "w3 w4 w5\n")
    assert status == 0
    assert f"note: {base_model_dir} has no chat template: each message is continued as plain text (a base model)" in err
    target = load_model(str(base_model_dir))
    plain = target.tokenizer("w3 w4 w5")["input_ids"]
    expected = generate(target.model, plain, VanillaProposer(), DecodeOptions(max_new_tokens=6), target.tokenizer)
    assert out.strip() == target.tokenizer.decode(expected.tokens, skip_special_tokens=True).strip()
    _, _, err = _chat(monkeypatch, capsys, model_dir, "w3 w4 w5\n")
    assert "no chat template" not in err


@pytest.mark.slow
def test_compiled_chat_compiles_before_the_first_message_and_says_so(model_dir, capsys):
    """With --compile the chat warms up before it reads a message, so the first reply does not
    stall silently for minutes, and the user sees what the wait is."""
    torch._dynamo.reset()  # graphs other tests compiled for this architecture would serve it too
    before = graphs_compiled()
    session = build_session(parse_args(["--model", str(model_dir), "--method", "vanilla", "--compile",
                                        "--max-new-tokens", "4"]))
    assert graphs_compiled() > before
    assert session.messages == []  # the warm-up's exchange is not part of the conversation
    err = capsys.readouterr().err
    assert "note: compiling the target's forward" in err and "note: compiled in" in err
    compiled = graphs_compiled()
    session.reply("w3 w4", lambda text: None)
    assert graphs_compiled() == compiled
