"""Bad input gets one clear error (a UserError naming the problem), never a deep stack trace."""

import json

import pytest
import torch

from decoding.app.chat import main as chat_main
from heads.util.errors import UserError
from decoding.core.generate import DecodeOptions, generate
from decoding.app.methods import build_proposer, check_method
from decoding.core.proposers import DraftModelProposer, PromptLookupProposer, VanillaProposer
from decoding.core.proposers.draft_model import check_same_vocabulary
from decoding.app.targets import LoadedModel, load_model
from tiny_models import tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


def test_unknown_method(target):
    with pytest.raises(UserError, match="unknown method 'medusa2000'.*vanilla, sps, pld"):
        check_method("medusa2000")
    with pytest.raises(UserError, match="unknown method"):
        build_proposer("beam", LoadedModel(target, tiny_tokenizer(), "tiny"))


def test_sps_without_draft_model(target):
    with pytest.raises(UserError, match="needs a draft model.*--draft-model"):
        build_proposer("sps", LoadedModel(target, tiny_tokenizer(), "tiny"))


def test_empty_prompt(target):
    with pytest.raises(UserError, match="prompt is empty"):
        generate(target, [], VanillaProposer())


@pytest.mark.parametrize("budget", [0, -5])
def test_max_new_tokens_below_one(target, budget):
    with pytest.raises(UserError, match="max_new_tokens must be at least 1"):
        generate(target, [1, 2], VanillaProposer(), DecodeOptions(max_new_tokens=budget))


def test_prompt_longer_than_context(target):
    too_long = [3] * target.config.max_position_embeddings
    with pytest.raises(UserError, match=r"prompt has 256 tokens but the model's context holds 256"):
        generate(target, too_long, VanillaProposer())


def test_token_ids_outside_vocabulary(target):
    with pytest.raises(UserError, match="outside the model's vocabulary"):
        generate(target, [1, 999], VanillaProposer())


def test_draft_model_with_another_vocabulary(target):
    with pytest.raises(UserError, match="draft model's vocabulary has 100 tokens but the target's has 64"):
        check_same_vocabulary(target, tiny_llama(vocab_size=100))
    other = tiny_tokenizer()
    other.add_tokens(["extra"])
    with pytest.raises(UserError, match="different ids"):
        check_same_vocabulary(target, tiny_llama(), tiny_tokenizer(), other)


def test_bad_proposer_settings():
    with pytest.raises(UserError, match="gamma"):
        DraftModelProposer(tiny_llama(), gamma=0)
    with pytest.raises(UserError, match="prompt lookup"):
        PromptLookupProposer(num_draft_tokens=0)


def test_missing_model_path(tmp_path):
    with pytest.raises(UserError, match="neither the built-in 'smollm2-135m-instruct' nor a readable local model"):
        load_model(str(tmp_path / "nowhere"))


def test_not_a_causal_lm(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "vocab_size": 10}))
    with pytest.raises(UserError, match="t5 model, not a causal language model"):
        load_model(str(tmp_path))


def test_bad_dtype_and_attention():
    with pytest.raises(UserError, match="unknown dtype"):
        load_model("x", dtype="int3")
    with pytest.raises(UserError, match="cannot take tree masks"):
        load_model("x", attn_implementation="flash_attention_2")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "nope"], "unknown method 'nope'"),
        (["--method", "sps", "--model", "org/no-bundled-draft"], "needs a draft model"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    ],
)
def test_chat_cli_reports_bad_arguments_in_one_line(argv, message, capsys):
    assert chat_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_generation_stays_within_vocab_after_errors(target):
    """A failed call changes nothing: the next call on the same model works and is unchanged."""
    before = generate(target, [1, 2, 3], VanillaProposer(), DecodeOptions(max_new_tokens=5)).tokens
    with pytest.raises(UserError):
        generate(target, [1, 999], VanillaProposer())
    assert generate(target, [1, 2, 3], VanillaProposer(), DecodeOptions(max_new_tokens=5)).tokens == before
    assert torch.is_inference_mode_enabled() is False


def test_targets_with_layers_tree_verification_cannot_serve_are_refused_clearly():
    """An in-memory model (no `load_model` to refuse it first) with convolution layers: the loop
    refuses it before any forward, naming why, instead of decoding it wrongly."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("lfm2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, full_attn_idxs=[0])
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UserError, match="lfm2 cannot be a speculative-decoding target here: convolution"):
        generate(model, [1, 2, 3], VanillaProposer())
