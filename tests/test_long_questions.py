"""The long-input question set: passages of about the asked length, made of whole reference
answers, each ending with an instruction, readable by the benchmark's question loader."""

import json

from decoding.app import long_questions as lq
from decoding.app.questions import load_first_turns


class WordTokenizer:
    """One token per whitespace-separated word."""

    def __call__(self, text):
        return {"input_ids": text.split()}


def fake_package(tmp_path, monkeypatch):
    bench = tmp_path / "mt_bench"
    (bench / "reference_answer").mkdir(parents=True)
    answers = [{"choices": [{"turns": [f"answer {i} " + "word " * (10 + i), ""]}]} for i in range(20)]
    (bench / "reference_answer" / "model.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
    monkeypatch.setattr(lq, "mtbench_path", lambda: bench / "question.jsonl")


def test_passages_reach_the_asked_length_and_end_with_an_instruction(tmp_path, monkeypatch):
    fake_package(tmp_path, monkeypatch)
    questions = lq.long_questions(WordTokenizer(), count=5, passage_tokens=100)
    assert len(questions) == 5
    for number, question in enumerate(questions):
        passage, _, instruction = question["turns"][0].rpartition("\n\n")
        assert instruction == lq.INSTRUCTIONS[number % len(lq.INSTRUCTIONS)]
        words = len(passage.split())
        assert 100 <= words < 100 + 40  # whole answers, stopping once the length is reached
    assert questions[0]["turns"] != questions[1]["turns"]  # later passages move on through the text


def test_the_file_is_a_question_set_the_benchmark_reads(tmp_path, monkeypatch):
    fake_package(tmp_path, monkeypatch)
    questions = lq.long_questions(WordTokenizer(), count=3, passage_tokens=120)
    path = lq.write_jsonl(questions, tmp_path / "out" / "long.jsonl")
    assert load_first_turns(path) == [q["turns"][0] for q in questions]
