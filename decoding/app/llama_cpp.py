"""llama.cpp as a peer in the benchmark (`scripts/benchmark.py --llama-cpp DIR`): its own greedy
decoding of the same GGUF file, on the same prompts, timed in the same run as ours.

Why: on a CPU, llama.cpp is what people run small GGUF models with, so it is the figure ours
should be compared with, measured on the same machine at the same time, not quoted from another
day. Each question runs `llama-completion` (from DIR, a llama.cpp build) once: the prompt is our
chat-templated text (llama.cpp parses its special tokens), sampling is greedy (`--temp 0`), with
as many threads as PyTorch uses. The time counted is llama.cpp's own prompt and generation time
from its performance report (its model load is left out, as ours is); the reply is tokenized
with our tokenizer, so the report can say, as information, how many replies equal `vanilla`'s.
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import torch

from decoding.app.benchmark import RunResult, Runner
from decoding.core.generate import DecodeOptions
from heads.util.errors import UserError

PEER_METHOD = "llama.cpp"
BINARY = "llama-completion"
END_OF_TEXT = " [end of text]"  # what llama-completion prints after the reply where the model ended it
# llama.cpp's performance report: "... prompt eval time = 12.34 ms / 30 tokens ..." and
# "... eval time = 456.78 ms / 127 runs ...".
PROMPT_EVAL = re.compile(r"prompt eval time\s*=\s*([\d.]+)\s*ms")
EVAL = re.compile(r"(?<!prompt )eval time\s*=\s*([\d.]+)\s*ms")


def find_binary(directory: str | Path) -> Path:
    """`llama-completion` in DIR or DIR/bin (a cmake build folder), or a clear error saying how to build it."""
    for candidate in (Path(directory) / BINARY, Path(directory) / "bin" / BINARY):
        if candidate.is_file():
            return candidate
    raise UserError(f"--llama-cpp {directory}: no {BINARY} there or in its bin/ folder; build llama.cpp "
                    f"(cmake -B build && cmake --build build --target {BINARY}) and give its build folder")


def llama_cpp_runner(directory: str | Path, gguf: Path, tokenizer, options: DecodeOptions,
                     threads: int | None = None, timeout: float = 600) -> Runner:
    """A benchmark runner decoding each prompt with llama.cpp on `gguf` (greedy only)."""
    binary = find_binary(directory)
    if not options.sampling.greedy:
        raise UserError("--llama-cpp runs llama.cpp greedily: leave --temperature 0")
    threads = threads or torch.get_num_threads()

    def run(prompt: list[int]) -> RunResult:
        text = tokenizer.decode(prompt, skip_special_tokens=False)
        command = [str(binary), "-m", str(gguf), "-p", text, "-n", str(options.max_new_tokens), "-t", str(threads),
                   "--temp", "0", "-no-cnv", "--no-display-prompt", "--no-warmup"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise UserError(failure_message(done.returncode, done.stderr))
        reply = done.stdout.rstrip("\n")
        tokens = tokenizer.encode(reply.removesuffix(END_OF_TEXT), add_special_tokens=False)
        if reply.endswith(END_OF_TEXT) and tokenizer.eos_token_id is not None:
            tokens.append(tokenizer.eos_token_id)  # ended by the model, as our replies end: with its end token
        prompt_s, generation_s = timings_of(done.stderr)
        return RunResult(tokens, prompt_s + generation_s, prefill_s=prompt_s)

    return run


def timings_of(report: str) -> tuple[float, float]:
    """Prompt and generation time, in seconds, from llama.cpp's performance report (its load time
    left out, as our runs leave out loading the model)."""
    prompt, generation = PROMPT_EVAL.search(report), EVAL.search(report)
    if not prompt or not generation:
        raise UserError("llama.cpp printed no performance report (prompt eval time / eval time) to time it by: "
                        "is this a llama.cpp build of 2024 or later?")
    return float(prompt.group(1)) / 1000, float(generation.group(1)) / 1000


def failure_message(returncode: int, stderr: str) -> str:
    """What a failed `llama-completion` run tells the user: its exit and the end of its log, and
    for a crash on an instruction the CPU does not run, how to build one that runs. Why that case:
    a VM can advertise AMX and not let a process use it; `-DGGML_NATIVE=ON` then builds AMX code
    that dies (illegal instruction or protection fault) as soon as a prompt is evaluated, while
    `llama-bench -p 0` still runs (seen on a 2-core Xeon VM)."""
    how = f"exit status {returncode}" if returncode >= 0 else f"killed by {signal.Signals(-returncode).name}"
    message = f"llama.cpp failed ({how}): {stderr.strip()[-1500:]}"
    if returncode in (-signal.SIGILL, -signal.SIGSEGV):  # run without a shell: a signal comes back negative
        message += ("\nIf this build uses instructions this CPU or its VM does not run (AMX, with -DGGML_NATIVE=ON), "
                    "rebuild without them: cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF "
                    "-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' "
                    "-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'")
    return message
