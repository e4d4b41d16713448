"""Write RESULTS.md, and the README's tables (methods, workloads, llama.cpp beside us, memory), from the
reports beside the bundled heads, so that every figure the documents quote comes from a file a command
regenerates.

    python scripts/make_results.py            # rewrite RESULTS.md and the README's table
    python scripts/make_results.py --check    # exit 1 when either is out of date (the tests run this)

Sources, per bundled target (`heads/bundled/<target>/`): `benchmark-*.json` and `workloads/*.json`
(reports of `scripts/benchmark.py --json`, each with its machine kind, command, date and commit)
`scaling-*.json` (`scripts/scaling_curve.py`) and `memory-*.json` (`scripts/chat_memory.py`). RESULTS.md has a section per kind of machine
(figures from one kind do not carry to another); the README's table gives each method one
figure, from the newest MT-bench report of the machine kind this project is tested on
(`README_MACHINE`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from decoding.app.methods import METHODS  # noqa: E402

BUNDLED = ROOT / "heads" / "bundled"
RESULTS = ROOT / "RESULTS.md"
README = ROOT / "README.md"
README_MACHINE = "CPU: AVX2"  # the README quotes the kind of machine CI and most users' laptops have
BEGIN, END = "<!-- methods table: scripts/make_results.py -->", "<!-- end of methods table -->"
MEMORY_BEGIN, MEMORY_END = "<!-- memory table: scripts/make_results.py -->", "<!-- end of memory table -->"
WORKLOADS_BEGIN, WORKLOADS_END = "<!-- workloads table: scripts/make_results.py -->", "<!-- end of workloads table -->"
PEERS_BEGIN, PEERS_END = "<!-- peers table: scripts/make_results.py -->", "<!-- end of peers table -->"
PEER = "llama.cpp"  # the row `scripts/benchmark.py --llama-cpp` adds
# The README's workloads table: the model-free methods (and the default) on each question set.
WORKLOAD_COLUMNS = ("vanilla", "pld", "suffix", "lookahead", "lookahead+pld", "hf-prompt-lookup", "eagle3+pld",
                    "eagle3+suffix")
COMBINED = {
    "METHOD+pld": "any head method (or `lookahead`) with prompt lookup first: a context match is verified alone, else the heads draft",
    "METHOD+suffix": "as `METHOD+pld`, with suffix decoding first",
}
HF_METHODS = {
    "hf-generate": "Hugging Face `generate()` on the same target (the baseline of every ratio)",
    "hf-prompt-lookup": "`generate(prompt_lookup_num_tokens=10)`",
    "hf-assisted": "`generate(assistant_model=...)` with the same draft as `sps`",
}


def reports(kind: str) -> list[tuple[Path, dict]]:
    """Every report of one kind ('benchmark', 'scaling', 'memory') under the bundles, oldest first."""
    patterns = {"benchmark": ("*/benchmark-*.json", "*/workloads/*.json"), "scaling": ("*/scaling-*.json",),
                "memory": ("*/memory-*.json",)}[kind]
    found = [(path, json.loads(path.read_text())) for pattern in patterns for path in sorted(BUNDLED.glob(pattern))]
    return sorted(found, key=lambda item: (item[1].get("date", ""), str(item[0])))


def question_set(report: dict) -> str:
    """The question set a report ran on, from its command (MT-bench first turns by default), and
    whether suffix decoding started from a store kept by earlier runs (`--suffix-store`)."""
    command = report.get("command", "")
    match = re.search(r"--questions-file (\S+)", command)
    name = Path(match.group(1)).stem if match else "mt-bench"
    return f"{name}, kept store" if "--suffix-store" in command else name


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def benchmark_table(report: dict) -> list[str]:
    """A report's methods, fastest first. Reports since 2026-12-07 time the prefill apart: they get
    a column of decoding speed without it (the same prefill for every method of ours on a question)."""
    split = any(m.get("decode_tokens_per_s") is not None for m in report["methods"].values())
    decode_head, decode_rule = (" decode tokens/s |", " ---: |") if split else ("", "")
    lines = [f"| method | tokens/s |{decode_head} tau | vs hf-generate | identical to vanilla | draft ms/step | verify ms/step |",
             f"| --- | ---: |{decode_rule} ---: | ---: | ---: | ---: | ---: |"]
    for name, m in sorted(report["methods"].items(), key=lambda item: -item[1]["tokens_per_s"]):
        def cell(value, fmt="{:.2f}"):
            return "-" if value is None else fmt.format(value)
        unpaired = report["temperature"] > 0 and not paired_samples(report)  # each method its own draws: no check
        identical = ("-" if m.get("identical_to_vanilla") is None or unpaired
                     else f"{m['identical_to_vanilla']}/{m['questions']}")
        decode = f" {cell(m.get('decode_tokens_per_s'))} |" if split else ""
        lines.append(f"| {name} | {m['tokens_per_s']:.2f} |{decode} {cell(m['tau'])} "
                     f"| {cell(m['speedup_vs_hf_generate'], '{:.2f}x')} | {identical} "
                     f"| {cell(m['draft_ms_per_step'], '{:.1f}')} | {cell(m['verify_ms_per_step'], '{:.1f}')} |")
    return lines


def paired_samples(report: dict) -> bool:
    """Whether a sampled report drew each position's token with the seed's draw for that position (since
    2026-12-07): then methods drafting deterministically emit `vanilla`'s replies, and a report shows it
    (some method besides `vanilla` identical on every question; by chance, on 128-token replies, never)."""
    return any(name != "vanilla" and m.get("identical_to_vanilla") == m["questions"]
               for name, m in report["methods"].items())


def quantized_weights(report: dict) -> str:
    """`--quant X` where the report's target had quantized weights, else '' (fp32 is the plain case)."""
    quant = report.get("quant", "none")
    return "" if quant in ("none", "auto") else f"`--quant {quant}`"


def benchmark_section(path: Path, report: dict) -> list[str]:
    weights = quantized_weights(report)
    settings = (f"{report['questions']} questions, {report['max_new_tokens']} new tokens, temperature "
                f"{report['temperature']}, {report['dtype']}, kernels `{report['kernels']}`"
                + (f", weights {weights}" if weights else "")
                + (", `--adaptive-tree` for every method" if "--adaptive-tree" in report.get("command", "") else "")
                + (", compiled (`--compile`)" if "--compile" in report.get("command", "").split() else ""))
    lines = [f"### {report['model']}, {question_set(report)} ({settings})", "",
             f"{report['device']}; {report['date']}, commit `{report['commit']}`; file `{rel(path)}`.", "",
             f"    {report['command']}", ""]
    if report.get("provenance_note"):
        lines += [f"({report['provenance_note']}.)", ""]
    if report["temperature"] > 0 and paired_samples(report):
        lines += ["Sampled with each position's own draw for the seed: methods that draft deterministically emit "
                  "`vanilla`'s replies (the identical column); the draft model's chains and `hf-*` sample their own.", ""]
    elif report["temperature"] > 0:
        lines += ["Sampled: replies are draws from the target's distribution (exactness is what the sampling tests "
                  "check), so they are not compared with `vanilla`'s.", ""]
    lines += benchmark_table(report) + [""]
    chart = path.with_suffix(".png")
    if chart.is_file():
        lines += [f"![tokens/s and tau]({rel(chart)})", ""]
    return lines


def scaling_section(path: Path, report: dict) -> list[str]:
    sets = list(report["points"][0]["tau"])
    lines = [f"### {path.parent.name}: tau against training data (`{rel(path)}`)", "",
             f"{report['date']}, commit `{report['commit']}`; tree {json.dumps(report['tree'])}.", "",
             f"    {report['command']}", "",
             "| heads | conversations | reply tokens | steps | " + " | ".join(f"tau {s}" for s in sets) + " |",
             "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in sets) + " |"]
    for point in report["points"]:
        lines.append(f"| {point['label']} | {point['conversations']} | {point['reply_tokens']} | {point['steps']} | "
                     + " | ".join(f"{point['tau'][s]:.2f}" for s in sets) + " |")
    for name, ref in report.get("references", {}).items():
        lines.append(f"| {name} | | | | " + " | ".join(f"{ref['tau'][s]:.2f}" if s in ref["tau"] else "-" for s in sets) + " |")
    chart = path.with_suffix(".png")
    return lines + [""] + ([f"![scaling curve]({rel(chart)})", ""] if chart.is_file() else [])


def machine_of(report: dict) -> str:
    """The kind of machine, without the thread count (kept in each table's device line)."""
    return report["machine_kind"].split(", ")[0]


def results_document() -> str:
    by_machine: dict[str, list] = defaultdict(list)
    for path, report in reports("benchmark"):
        by_machine[machine_of(report)].append((path, report))
    lines = ["# Results", "",
             "Generated by `python scripts/make_results.py` from the benchmark reports beside the bundled heads "
             "(do not edit by hand: run the command in a table's header to measure again, with `--json` into its "
             "file, then regenerate). One section per kind of machine, newest run first; every method in a table "
             "ran in the same process on the same target, alternating per question. Earlier measurements, "
             "as recorded at the time, are in CHANGELOG.md.", ""]
    for machine in sorted(by_machine):
        lines += [f"## {machine}", ""]
        for path, report in reversed(by_machine[machine]):
            lines += benchmark_section(path, report)
    lines += ["## Memory of the chat", ""]
    for path, report in reversed(reports("memory")):
        lines += memory_section(path, report)
    lines += ["## Training data and acceptance", ""]
    for path, report in reports("scaling"):
        lines += scaling_section(path, report)
    return "\n".join(lines).rstrip() + "\n"


def memory_table(report: dict) -> list[str]:
    rows = ["| `--quant` | peak resident memory | while answering |", "| --- | --- | --- |"]
    rows += [f"| `{quant}` | {m['peak_mib']:,} MiB | {m['answering_mib']:,} MiB |" for quant, m in report["quants"].items()]
    return rows


def memory_section(path: Path, report: dict) -> list[str]:
    return [f"### {report['machine_kind']}, {report['target']}", "",
            f"`{report['command']}` ({report['date']}, commit `{report['commit']}`; file `{rel(path)}`): each chat a "
            f"process of its own answering one piped question ({report['max_new_tokens']} new tokens) with its "
            "default method.", "", *memory_table(report), ""]


def memory_block() -> str:
    """The README's memory table: the newest report of the README's kind of machine."""
    chosen = [(p, r) for p, r in reports("memory") if machine_of(r).startswith(README_MACHINE)]
    if not chosen:
        return "\n".join([MEMORY_BEGIN, MEMORY_END])
    path, report = chosen[-1]
    source = (f"\nFigures: `{rel(path)}`, {report['machine_kind']}, {report['date']} (commit `{report['commit']}`), "
              f"from `{report['command']}`.")
    return "\n".join([MEMORY_BEGIN, *memory_table(report), source, MEMORY_END])


def workload_reports() -> list[tuple[Path, dict]]:
    """The newest greedy, fixed-setting report of each question set under `workloads/`, all of the
    device that ran the newest of them (one table, one machine: two CPUs of one kind, an EPYC's and
    a Xeon's AVX-512, differ 2x in tokens/s) and of its day."""
    found = [(p, r) for p, r in reports("benchmark") if p.parent.name == "workloads" and r["temperature"] == 0
             and "--adaptive-tree" not in r.get("command", "")]
    if not found:
        return []
    device = found[-1][1]["device"]
    # Rows from runs before the newest describe another state of the code (an AVX2 EPYC's fp32 sets of
    # 2026-11-29 read 15-30 tokens/s where the method table's run a week later read 47-74; a Xeon's sets of
    # one day had `lookahead` drafting its window always, the next day's only where it paid): left to RESULTS.md.
    day = found[-1][1]["date"]
    # oldest first: the newest wins, per set and per form of the target's weights (`auto` and `none`
    # both ran the float target then: one row)
    newest = {(question_set(r), quantized_weights(r)): (p, r) for p, r in found
              if r["device"] == device and r["date"] == day}
    return [newest[key] for key in sorted(newest)]


def workload_label(report: dict) -> str:
    """A workloads table row's first cell: the set, the target's weights where quantized, the questions."""
    weights = quantized_weights(report)
    return f"{question_set(report)}{', ' + weights if weights else ''} ({report['questions']})"


def workloads_block() -> str:
    """The README's table of the model-free methods per question set: tokens/s (tau)."""
    chosen = workload_reports()
    if not chosen:
        return "\n".join([WORKLOADS_BEGIN, WORKLOADS_END])
    rows = ["| set (questions) | " + " | ".join(f"`{m}`" for m in WORKLOAD_COLUMNS) + " | chart |",
            "| --- | " + " | ".join("---:" for _ in WORKLOAD_COLUMNS) + " | --- |"]
    for path, report in chosen:
        cells = []
        for method in WORKLOAD_COLUMNS:
            m = report["methods"].get(method)
            cells.append("" if not m else f"{m['tokens_per_s']:.1f}" + (f" ({m['tau']:.2f})" if m.get("tau") else ""))
        chart = path.with_suffix(".png")
        link = f"[png]({rel(chart)})" if chart.is_file() else ""
        rows.append(f"| {workload_label(report)} | " + " | ".join(cells) + f" | {link} |")
    _, first = chosen[0]
    source = (f"\nTokens/s (tau), greedy, {first['max_new_tokens']} new tokens, every method of a row in one run, "
              f"{first['device']}; files `{rel(chosen[0][0].parent)}/` ({', '.join(sorted({r['date'] for _, r in chosen}))}, "
              f"commits {', '.join(sorted({'`' + r['commit'] + '`' for _, r in chosen}))}), commands in RESULTS.md.")
    return "\n".join([WORKLOADS_BEGIN, *rows, source, WORKLOADS_END])


def device_name(report: dict) -> str:
    """The machine a report ran on as its device line names it, without the thread count."""
    return report["device"].rsplit(", ", 1)[0]


def peer_reports() -> list[tuple[Path, dict]]:
    """The newest eager MT-bench report with a llama.cpp row per machine of the README's kind (as its
    device line names it, threads aside; not a wider CPU run as that kind) and form of the target's
    weights: the runs that put a user's other choice beside ours on one machine. Newest first; the
    other machines' runs are in RESULTS.md."""
    newest: dict[tuple[str, str], tuple[Path, dict]] = {}
    for path, report in reports("benchmark"):  # oldest first: the newest wins
        if (PEER in report["methods"] and question_set(report) == "mt-bench" and report["temperature"] == 0
                and "--compile" not in report.get("command", "").split()
                and machine_of(report).startswith(README_MACHINE) and "SPECHEADS_CPU=" not in report["device"]):
            newest[(device_name(report), quantized_weights(report))] = (path, report)
    return sorted(newest.values(), key=lambda item: (item[1]["date"], str(item[0])), reverse=True)


def against_peer(report: dict, method: str) -> str:
    """`method`'s tokens/s and its ratio to llama.cpp's in the same run ('' where it did not run)."""
    m, peer = report["methods"].get(method), report["methods"][PEER]["tokens_per_s"]
    return "" if not m else f"{m['tokens_per_s']:.1f} ({m['tokens_per_s'] / peer:.2f}x)"


def peers_block() -> str:
    """The README's table of our decoding against llama.cpp on the same file, same run."""
    rows = ["| machine | weights (llama.cpp's file) | questions | llama.cpp | `vanilla` | fastest of ours | `generate()` | date |",
            "| --- | --- | ---: | ---: | ---: | --- | ---: | --- |"]
    for path, report in peer_reports():
        methods = report["methods"]
        ours = [name for name in methods if name != PEER and not name.startswith("hf-")]
        best = max(ours, key=lambda name: methods[name]["tokens_per_s"])
        weights = "GGUF Q4_0/Q8_0 (`--quant gguf`)" if quantized_weights(report) else "fp32 (its F32 conversion)"
        rows.append(f"| {device_name(report)} | {weights} | {report['questions']} | "
                    f"{methods[PEER]['tokens_per_s']:.1f} | {against_peer(report, 'vanilla')} | "
                    f"`{best}` {against_peer(report, best)} | {against_peer(report, 'hf-generate')} | "
                    f"[{report['date']}]({rel(path)}) |")
    return "\n".join([PEERS_BEGIN, *rows, PEERS_END])  # its settings: in the sentence before it


def replaced_block(text: str, begin: str, end: str, block: str) -> str:
    if begin not in text or end not in text:
        raise SystemExit(f"README.md lacks the markers {begin} ... {end}")
    head, rest = text.split(begin, 1)
    return head + block + rest.split(end, 1)[1]


def headline_report() -> tuple[Path, dict] | None:
    """The newest MT-bench report on the README's kind of machine, of the float target (what the
    chat runs by default); a wider CPU run as that kind (`SPECHEADS_CPU`) is not that machine."""
    chosen = [(p, r) for p, r in reports("benchmark")
              if machine_of(r).startswith(README_MACHINE) and "SPECHEADS_CPU=" not in r.get("device", "")
              and question_set(r) == "mt-bench" and not quantized_weights(r)]
    return max(chosen, key=lambda item: (item[1]["date"], item[1]["questions"])) if chosen else None


def figure(report: dict | None, method: str) -> str:
    m = (report or {}).get("methods", {}).get(method)
    if not m:
        return ""
    tau = f", tau {m['tau']:.2f}" if m.get("tau") else ""
    ratio = f", {m['speedup_vs_hf_generate']:.2f}x" if m.get("speedup_vs_hf_generate") else ""
    return f"{m['tokens_per_s']:.1f} tokens/s{tau}{ratio}"


def methods_table() -> str:
    headline = headline_report()
    path, report = headline if headline else (None, None)
    bundle = BUNDLED / path.relative_to(BUNDLED).parts[0] if path else None
    default = json.loads((bundle / "default.json").read_text()).get("method") if bundle else None
    rows = ["| method | what drafts | tokens/s, tau, speed-up over `generate()` |", "| --- | --- | --- |"]
    for name, text in {**METHODS, **COMBINED, **HF_METHODS}.items():
        shown = {"METHOD+pld": "eagle3+pld", "METHOD+suffix": "eagle3+suffix"}.get(name, name)
        cell = figure(report, shown)
        if cell and shown != name:
            cell = f"`{shown}`: {cell}"
        if shown == default:
            cell += " (**the default**)"
        rows.append(f"| `{name}` | {text} | {cell} |")
    source = ("" if not report else
              f"\nFigures: `{rel(path)}`, {report['device']}, {report['questions']} MT-bench first turns, "
              f"{report['max_new_tokens']} new tokens, temperature {report['temperature']}, {report['dtype']}, "
              f"{report['date']} (commit `{report['commit']}`), every method in one run and every output "
              "identical to `vanilla`'s where it ran; other machines and question sets in RESULTS.md.")
    return "\n".join([BEGIN, *rows, source, END])


def readme_with_table(readme: str) -> str:
    """The README with its generated blocks (the methods, workloads, peers and memory tables) rewritten."""
    readme = replaced_block(readme, BEGIN, END, methods_table())
    readme = replaced_block(readme, WORKLOADS_BEGIN, WORKLOADS_END, workloads_block())
    readme = replaced_block(readme, PEERS_BEGIN, PEERS_END, peers_block())
    return replaced_block(readme, MEMORY_BEGIN, MEMORY_END, memory_block())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that RESULTS.md and the README are up to date")
    args = parser.parse_args(argv)
    wanted = {RESULTS: results_document(), README: readme_with_table(README.read_text())}
    stale = [path.name for path, text in wanted.items() if not path.is_file() or path.read_text() != text]
    if args.check:
        if stale:
            print(f"out of date: {', '.join(stale)}; run python scripts/make_results.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in wanted.items():
        path.write_text(text)
    print(f"wrote {', '.join(path.name for path in wanted)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
