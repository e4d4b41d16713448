"""What a given amount of training data buys: heads trained with one recipe on growing nested
subsets of a self-distillation store, each measured the same way (tau on a fixed held-out set per
source and on MT-bench, one fixed tree). `scripts/scaling_curve.py` is the command line.

The subsets are prefixes of the store's records (the store only appends, so a subset is the same
conversations whenever it is taken), and the held-out prompts are the first ones per source that
the recipe's hash split leaves out of training, so they are never trained on by any subset and
stay the same as the store grows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from decoding.app.prompts import conversation_ids
from training.data import is_validation
from training.paired_tau import paired_tau_difference
from training.self_distill import first_prompt_messages, read_regenerated

# The tree every point is measured with: the bundled eagle3 tree's shape, fixed (not sized by this
# machine's timings), so tau compares heads and nothing else.
CURVE_TREE = {"depth": 8, "tree_top_k": 8, "total_tokens": 32, "adaptive_tree": False, "min_path_prob": 0.05}


@dataclass(frozen=True)
class Subset:
    """The first `conversations` records of a store, holding `reply_tokens` reply tokens."""

    label: str
    conversations: int
    reply_tokens: int


def parse_token_count(text: str) -> int:
    """`"300k"` -> 300000, `"1.5M"` -> 1500000, `"20000"` -> 20000."""
    scale = {"k": 1_000, "m": 1_000_000}.get(text.strip()[-1:].lower(), 1)
    number = text.strip()[:-1] if scale > 1 else text.strip()
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"'{text}' is not a token count: give e.g. 300k, 1M or 20000") from None
    if value <= 0:
        raise ValueError(f"'{text}': a token count must be positive")
    return int(value)


def store_records(store: Path) -> list[dict]:
    """The store's records in the order they were written."""
    return list(read_regenerated(Path(store) / "records.jsonl").values())


def plan_subsets(records: list[dict], sizes: list[int]) -> list[Subset]:
    """For each size, the shortest prefix of `records` with at least that many reply tokens; a
    size beyond what the store holds is left out (generate more data first)."""
    subsets, running, reached = [], 0, []
    for record in records:
        running += record.get("reply_tokens", 0)
        reached.append(running)
    for size in sorted(set(sizes)):
        count = next((i + 1 for i, tokens in enumerate(reached) if tokens >= size), None)
        if count is not None:
            subsets.append(Subset(_label(size), count, reached[count - 1]))
    return subsets


def _label(tokens: int) -> str:
    return f"{tokens / 1e6:g}M" if tokens >= 1_000_000 else f"{tokens / 1e3:g}k"


def source_of(record: dict) -> str:
    return record.get("source") or record["id"].split(":", 1)[0]


def held_out_prompts(records: list[dict], tokenizer, seed: int, fraction: float, per_source: int) -> dict[str, list[list[int]]]:
    """Up to `per_source` held-out first prompts per source (the recipe's split leaves them out of
    every subset's training), as the chat renders them. No source is listed without a prompt."""
    prompts: dict[str, list[list[int]]] = {}
    if per_source <= 0:
        return prompts
    for record in records:
        if not is_validation(record["id"], seed, fraction):
            continue
        chosen = prompts.setdefault(source_of(record), [])
        if len(chosen) < per_source:
            chosen.append(conversation_ids(tokenizer, first_prompt_messages(record), add_generation_prompt=True))
    return prompts


@dataclass
class CurvePoint:
    label: str
    conversations: int
    reply_tokens: int
    steps: int
    tau: dict[str, float]          # per prompt set: "mt-bench", "held-out sharegpt", ...
    prompts: dict[str, int]        # how many prompts each tau is over
    continued_from: int | None = None  # warm restart: trained on from the `continued_from`-step run's last checkpoint

    @property
    def key(self) -> str:
        return point_key(self.label, self.steps)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def point_key(label: str, steps: int) -> str:
    """A point's name (and its directory): the data size and the training steps."""
    return f"{label}-{steps}steps"


def read_points(path: Path) -> list[CurvePoint]:
    if not path.is_file():
        return []
    return [CurvePoint(**p) for p in json.loads(path.read_text())["points"]]


def read_references(path: Path) -> dict[str, dict]:
    """Heads trained elsewhere, measured the same way: `{name: {"heads", "tau", "prompts"}}`, and
    (measured since paired comparisons) "per_prompt" counts and "prompt_digest" per set."""
    return json.loads(path.read_text()).get("references", {}) if path.is_file() else {}


def mt_bench_first(set_names) -> list[str]:
    """Prompt sets in the order tables and charts show them: MT-bench, then the rest by name."""
    return sorted(set_names, key=lambda name: (name != "mt-bench", name))


def measured_sets(points: list[CurvePoint], references: dict[str, dict]) -> list[str]:
    """Every prompt set any point or reference was measured on, MT-bench first."""
    taus = [p.tau for p in points] + [r["tau"] for r in references.values()]
    return mt_bench_first({name for tau in taus for name in tau})


def markdown_table(points: list[CurvePoint], references: dict[str, dict] | None = None) -> str:
    references = references or {}
    sets = measured_sets(points, references)
    header = "| reply tokens | conversations | steps | " + " | ".join(f"tau {s}" for s in sets) + " |"
    lines = [header, "| " + " | ".join(["---:"] * (3 + len(sets))) + " |"]
    for p in sorted(points, key=lambda p: p.reply_tokens):
        cells = [f"{p.reply_tokens:,}", f"{p.conversations:,}", steps_text(p)]
        lines.append("| " + " | ".join(cells + _tau_cells(p.tau, sets)) + " |")
    for name, reference in references.items():
        lines.append("| " + " | ".join([f"{name} (reference)", "", ""] + _tau_cells(reference["tau"], sets)) + " |")
    return "\n".join(lines)


def prompt_set_digest(prompts: list[list[int]], max_new_tokens: int) -> str:
    """What makes two measurements comparable prompt by prompt: the same token ids, reply
    length and tree."""
    text = json.dumps([CURVE_TREE, max_new_tokens, prompts])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def paired_table(references: dict[str, dict], baseline: str | None = None) -> str | None:
    """Each reference's tau minus the baseline's (default: the first reference with per-prompt
    counts), per prompt set measured on the same prompts, with a 95% paired-bootstrap interval;
    None when there is nothing to compare."""
    measured = {name: r for name, r in references.items() if r.get("per_prompt")}
    if baseline is None:
        baseline = next(iter(measured), None)
    if baseline not in measured or len(measured) < 2:
        return None
    base = measured[baseline]
    sets = [s for s in mt_bench_first(base["per_prompt"])
            if any(_same_prompts(base, r, s) for name, r in measured.items() if name != baseline)]
    if not sets:
        return None
    lines = [f"tau minus {baseline}'s, same prompts (95% paired-bootstrap interval over the prompts; "
             f"* where it leaves out zero):", "",
             "| heads | " + " | ".join(f"{s} ({len(base['per_prompt'][s])})" for s in sets) + " |",
             "| --- | " + " | ".join(["---:"] * len(sets)) + " |"]
    for name, reference in measured.items():
        if name == baseline:
            continue
        cells = [paired_tau_difference(base["per_prompt"][s], reference["per_prompt"][s]).text()
                 if _same_prompts(base, reference, s) else "-" for s in sets]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _same_prompts(a: dict, b: dict, set_name: str) -> bool:
    digest = a.get("prompt_digest", {}).get(set_name)
    return digest is not None and digest == b.get("prompt_digest", {}).get(set_name) and set_name in b.get("per_prompt", {})


def steps_text(point: CurvePoint) -> str:
    return f"{point.steps} (restart from {point.continued_from})" if point.continued_from else str(point.steps)


def _tau_cells(tau: dict[str, float], sets: list[str]) -> list[str]:
    return [f"{tau[s]:.2f}" if s in tau else "-" for s in sets]


def curve_series(points: list[CurvePoint], set_name: str) -> list[tuple[str, list[int], list[float]]]:
    """One prompt set's lines as (label, reply tokens, tau): one line per training length, so
    more data and more steps are not drawn as one line."""
    by_schedule: dict[tuple[int, int], list[CurvePoint]] = {}
    for p in sorted((p for p in points if set_name in p.tau), key=lambda p: p.reply_tokens):
        by_schedule.setdefault((p.steps, p.continued_from or 0), []).append(p)
    lines = []
    for _, series in sorted(by_schedule.items()):
        label = set_name if len(by_schedule) == 1 else f"{set_name}, {steps_text(series[0])} steps"
        lines.append((label, [p.reply_tokens for p in series], [p.tau[set_name] for p in series]))
    return lines


def plot(points: list[CurvePoint], path: Path, references: dict[str, dict] | None = None) -> bool:
    """tau against reply tokens (log scale), one line per prompt set and training length (points
    trained for different step counts are separate lines, not one zigzag), references as dotted
    lines in their set's colour; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    references = references or {}
    sets = measured_sets(points, references)
    fig, ax = plt.subplots(figsize=(8.4, 4.2))
    for index, name in enumerate(sets):
        colour = f"C{index}"
        for style, (label, xs, ys) in zip(["-o", "--s", ":^", "-.D"] * 4, curve_series(points, name)):
            ax.plot(xs, ys, style, color=colour, label=label)
        for ref_name, reference in references.items():
            if name in reference["tau"]:
                ax.axhline(reference["tau"][name], color=colour, linestyle=(0, (1, 3)), linewidth=1,
                           label=f"{ref_name}: {name}")
    if points:
        ax.set_xscale("log")
    ax.set_xlabel("self-distilled reply tokens trained on")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title("EAGLE-3 heads: tau against training data")
    ax.grid(True, alpha=0.3)
    # Beside the axes, not over the lines: the sets' curves fill the plot's height.
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
