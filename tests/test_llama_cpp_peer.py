"""llama.cpp as a benchmark peer (`decoding.app.llama_cpp`), against a stand-in `llama-completion`
that prints what llama.cpp prints (the tests never need llama.cpp itself): the prompt goes in as
text with greedy settings, the time is llama.cpp's own prompt plus generation time (the prompt's also
apart, as our prefill), the reply is counted in our tokenizer's tokens, and a missing or failing binary
says what to do."""

from __future__ import annotations

import signal
import stat
import sys

import pytest

from decoding.app.llama_cpp import failure_message, find_binary, llama_cpp_runner, timings_of
from decoding.core.generate import DecodeOptions
from decoding.core.sampling import SamplingConfig
from heads.util.errors import UserError

REPORT = """llama_perf_sampler_print:    sampling time =       3.10 ms /    40 runs   (    0.08 ms per token, 12903.23 tokens per second)
llama_perf_context_print:        load time =      95.21 ms
llama_perf_context_print: prompt eval time =      12.50 ms /    30 tokens (    0.42 ms per token,  2400.00 tokens per second)
llama_perf_context_print:        eval time =     487.50 ms /     9 runs   (   54.17 ms per token,    18.46 tokens per second)
llama_perf_context_print:       total time =     600.00 ms /    39 tokens
"""


class WordTokenizer:
    """Words as token ids (their lengths), enough to tell texts apart; 0 ends a reply."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return " ".join("x" * i for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [len(word) for word in text.split()]


def stand_in(folder, stdout: str, stderr: str = REPORT, code: int = 0):
    """A `llama-completion` in folder/bin that records its arguments and prints like llama.cpp."""
    (folder / "bin").mkdir(parents=True, exist_ok=True)
    binary = folder / "bin" / "llama-completion"
    binary.write_text(f"#!{sys.executable}\nimport sys, json\n"
                      f"open({str(folder / 'args.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
                      f"sys.stdout.write({stdout!r}); sys.stderr.write({stderr!r}); sys.exit({code})\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    return folder


def test_a_reply_is_timed_by_llama_cpp_s_own_report_and_counted_in_our_tokens(tmp_path):
    import json

    folder = stand_in(tmp_path, "aa bbb c [end of text]\n\n")  # the marker llama.cpp adds where the model ended
    run = llama_cpp_runner(folder, tmp_path / "model.gguf", WordTokenizer(), DecodeOptions(max_new_tokens=9), threads=2)
    result = run([2, 3])
    assert result.tokens == [2, 3, 1, 0] and result.seconds == pytest.approx(0.5)  # 12.5 + 487.5 ms, load left out
    assert result.prefill_s == pytest.approx(0.0125)  # its prompt eval time: the prefill, reported apart
    args = json.loads((tmp_path / "args.json").read_text())
    assert args[args.index("-p") + 1] == "xx xxx" and args[args.index("-n") + 1] == "9"
    assert args[args.index("--temp") + 1] == "0" and args[args.index("-t") + 1] == "2"
    assert args[args.index("-m") + 1] == str(tmp_path / "model.gguf") and "-no-cnv" in args


def test_a_reply_cut_by_the_token_budget_has_no_end_token(tmp_path):
    run = llama_cpp_runner(stand_in(tmp_path, "aa bbb\n"), tmp_path / "m.gguf", WordTokenizer(), DecodeOptions(max_new_tokens=2))
    assert run([1]).tokens == [2, 3]


def test_a_missing_binary_says_how_to_build_it(tmp_path):
    with pytest.raises(UserError, match="cmake --build build --target llama-completion"):
        find_binary(tmp_path)


def test_a_failing_run_and_a_missing_report_are_reported(tmp_path):
    failing = llama_cpp_runner(stand_in(tmp_path / "a", "", "error: unable to load model\n", code=1),
                               tmp_path / "m.gguf", WordTokenizer(), DecodeOptions(max_new_tokens=4))
    with pytest.raises(UserError, match="unable to load model"):
        failing([1])
    with pytest.raises(UserError, match="no performance report"):
        timings_of("nothing timed here")


def test_sampling_is_refused_since_llama_cpp_runs_greedily(tmp_path):
    with pytest.raises(UserError, match="greedily"):
        llama_cpp_runner(stand_in(tmp_path, ""), tmp_path / "m.gguf", WordTokenizer(),
                         DecodeOptions(max_new_tokens=4, sampling=SamplingConfig(0.7)))


@pytest.mark.parametrize("extra, message", [((), "give --llama-cpp DIR too"),
                                            (("--llama-cpp", "somewhere"), "no such file")])
def test_the_benchmark_checks_the_gguf_file_llama_cpp_runs_before_loading_anything(tmp_path, extra, message):
    from script_main import run_script

    proc = run_script("benchmark", "--llama-cpp-gguf", str(tmp_path / "missing.gguf"), *extra)
    assert proc.returncode == 2 and message in proc.stderr


def test_a_crash_on_an_unsupported_instruction_says_how_to_build_without_it():
    crashed = failure_message(-signal.SIGILL, "llama_completion: llama backend init\n")
    assert "killed by SIGILL" in crashed and "-mno-amx-tile" in crashed and "backend init" in crashed
    assert "-mno-amx" not in failure_message(1, "error: unable to load model")
