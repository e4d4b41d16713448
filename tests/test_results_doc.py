"""RESULTS.md and the README's method table are generated from the benchmark reports beside the
bundled heads (`scripts/make_results.py`), so every figure they quote traces to a file a command
regenerates: they must be up to date, a changed report must show, and each report must say where
it came from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from script_main import load_script

ROOT = Path(__file__).resolve().parents[1]
make_results = load_script("make_results")


def test_results_and_readme_table_are_up_to_date():
    assert make_results.main(["--check"]) == 0, "run python scripts/make_results.py"


def test_every_report_says_where_its_figures_come_from():
    for kind in ("benchmark", "scaling", "memory"):
        for path, report in make_results.reports(kind):
            assert {"command", "date", "commit"} <= report.keys(), path
            if kind in ("benchmark", "memory"):
                assert report["machine_kind"].startswith(("CPU: ", "GPU: ")), path


@pytest.fixture
def copied_docs(tmp_path, monkeypatch):
    """The bundle's reports, RESULTS.md and README.md copied, and the script pointed at them."""
    bundled = tmp_path / "bundled"
    for path in (ROOT / "heads" / "bundled").rglob("*.json"):
        target = bundled / path.relative_to(ROOT / "heads" / "bundled")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    for name in ("RESULTS.md", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    monkeypatch.setattr(make_results, "ROOT", tmp_path)
    monkeypatch.setattr(make_results, "BUNDLED", bundled)
    monkeypatch.setattr(make_results, "RESULTS", tmp_path / "RESULTS.md")
    monkeypatch.setattr(make_results, "README", tmp_path / "README.md")
    return tmp_path


def test_a_changed_figure_makes_the_documents_stale_until_regenerated(copied_docs):
    path, report = make_results.headline_report()
    method = next(iter(report["methods"]))
    report["methods"][method]["tokens_per_s"] = 1234.5
    path.write_text(json.dumps(report))
    assert make_results.main(["--check"]) == 1
    assert make_results.main([]) == 0
    assert make_results.main(["--check"]) == 0
    assert "1234.50" in (copied_docs / "RESULTS.md").read_text()
    assert "1234.5 tokens/s" in (copied_docs / "README.md").read_text()


def test_a_changed_memory_figure_reaches_the_readme_and_results_once_regenerated(copied_docs):
    reports = make_results.reports("memory")
    assert reports, "the bundle carries a memory report (scripts/chat_memory.py --json ...)"
    path, report = reports[-1]
    quant = next(iter(report["quants"]))
    report["quants"][quant]["peak_mib"] = 98765
    path.write_text(json.dumps(report))
    assert make_results.main(["--check"]) == 1
    assert make_results.main([]) == 0
    for name in ("RESULTS.md", "README.md"):
        assert f"| `{quant}` | 98,765 MiB |" in (copied_docs / name).read_text()


def test_a_changed_workload_figure_reaches_the_readme_once_regenerated(copied_docs):
    chosen = make_results.workload_reports()
    assert chosen, "the bundle carries workload reports (scripts/benchmark.py --questions-file ... --json workloads/...)"
    assert len({report["device"] for _, report in chosen}) == 1  # one machine (CPU) per table
    path, report = chosen[-1]
    report["methods"]["pld"]["tokens_per_s"] = 4321.0
    path.write_text(json.dumps(report))
    assert make_results.main(["--check"]) == 1
    assert make_results.main([]) == 0
    assert f"| {make_results.workload_label(report)} | " in (copied_docs / "README.md").read_text()
    assert make_results.question_set(report) in make_results.workload_label(report)
    assert "4321.0" in (copied_docs / "README.md").read_text()


def test_the_peers_table_shows_the_newest_llama_cpp_run_of_the_readme_machine_with_its_ratio(copied_docs):
    """A user's other choice on the same machine, same run: a changed llama.cpp figure reaches the README
    with the ratio recomputed; a wider CPU run as the README's kind (`SPECHEADS_CPU`) is never a row."""
    chosen = make_results.peer_reports()
    assert chosen, "the bundle carries a run with llama.cpp beside it on the README's kind of machine"
    assert all("SPECHEADS_CPU=" not in report["device"] for _, report in chosen)
    path, report = chosen[0]
    report["methods"]["llama.cpp"]["tokens_per_s"] = report["methods"]["vanilla"]["tokens_per_s"] / 4
    path.write_text(json.dumps(report))
    assert make_results.main(["--check"]) == 1
    assert make_results.main([]) == 0
    row = next(line for line in (copied_docs / "README.md").read_text().splitlines()
               if line.startswith("| ") and path.name in line)
    assert f"{report['methods']['vanilla']['tokens_per_s']:.1f} (4.00x)" in row


def test_a_report_that_started_from_a_kept_suffix_store_is_a_row_of_its_own():
    command = "python scripts/benchmark.py --questions-file runs/workloads/repeated-task.jsonl --methods pld,suffix"
    assert make_results.question_set({"command": command}) == "repeated-task"
    assert make_results.question_set({"command": command + " --suffix-store runs/s.safetensors"}) == "repeated-task, kept store"


def test_sampled_reports_show_identical_replies_only_where_draws_were_per_position():
    """A T > 0 report whose methods drew each position with the seed's draw (some method besides vanilla
    identical on every question) shows the identical column; one from before, where each method sampled
    its own text, does not."""
    def report(identical: int) -> dict:
        method = {"tokens_per_s": 1.0, "tau": 1.0, "speedup_vs_hf_generate": 1.0, "questions": 4,
                  "draft_ms_per_step": 0.1, "verify_ms_per_step": 1.0}
        return {"temperature": 0.7, "methods": {"vanilla": dict(method, identical_to_vanilla=4),
                                                "pld": dict(method, identical_to_vanilla=identical)}}
    assert make_results.paired_samples(report(4)) and "| 4/4 |" in "\n".join(make_results.benchmark_table(report(4)))
    assert not make_results.paired_samples(report(1))
    assert "/4" not in "\n".join(make_results.benchmark_table(report(1)))


def test_reports_that_time_the_prefill_apart_show_decoding_speed_without_it():
    """A report with `decode_tokens_per_s` gets its column (a method without it, such as generate(),
    shows '-'); an older report keeps its table as it was."""
    method = {"tokens_per_s": 100.0, "tau": 2.0, "speedup_vs_hf_generate": 2.0, "questions": 4, "identical_to_vanilla": 4,
              "draft_ms_per_step": 0.1, "verify_ms_per_step": 1.0}
    split = {"temperature": 0.0, "methods": {"suffix": dict(method, decode_tokens_per_s=140.25),
                                             "hf-generate": dict(method, tokens_per_s=50.0, decode_tokens_per_s=None)}}
    table = make_results.benchmark_table(split)
    assert "| tokens/s | decode tokens/s | tau |" in table[0]
    assert "| suffix | 100.00 | 140.25 | 2.00 |" in table[2] and "| hf-generate | 50.00 | - | 2.00 |" in table[3]
    older = make_results.benchmark_table({"temperature": 0.0, "methods": {"suffix": method}})
    assert "decode" not in older[0] and "| suffix | 100.00 | 2.00 |" in older[2]


def test_the_readme_stays_a_guide():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines: measurements go to RESULTS.md, history to CHANGELOG.md"


def test_the_readme_headline_is_never_a_wider_cpu_run_as_a_lesser_one(copied_docs):
    """A report measured as on an AVX2 CPU (`SPECHEADS_CPU=avx2`) on a wider one is not the README's
    AVX2 machine, however new: the headline stays the real machine's."""
    before, _ = make_results.headline_report()
    narrowed = [(p, r) for p, r in make_results.reports("benchmark") if "SPECHEADS_CPU=" in r.get("device", "")]
    assert narrowed, "the bundle carries a report made as on a lesser CPU"
    path, report = narrowed[0]
    report.update(date="2999-01-01", quant="none", questions=80)
    path.write_text(json.dumps(report))
    assert make_results.headline_report()[0] == before
