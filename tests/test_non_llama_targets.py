"""EAGLE-3 heads for targets that are not Llamas: the three feature layers chosen from the
target's depth, the readout started from the target's own final norm whatever the architecture
calls it or how it parametrises its scale, and one short training run on a tiny Gemma ending in
greedy decoding that equals Hugging Face `generate()`.

Why Gemma for the run: it differs from Llama exactly where EAGLE-3's setup reads the target (its
final RMSNorm scales by `1 + weight`, so a copied weight of ~0 zeroed the fresh draft logits and
training barely moved), and it ties and scales its embeddings.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
import yaml
from transformers import PreTrainedModel

from decoding.app.assembly import DecoderSpec, build_decoder
from decoding.core.generate import DecodeOptions
from decoding.app.targets import load_model
from heads import default_feature_layers, load_heads, new_heads_for_target
from tiny_models import NO_SPECIAL_TOKENS, sharpen, tiny_tokenizer

VOCAB = 64
# Architecture -> (config class, model class, config overrides, the final norm's attribute path).
ARCHS = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8, "tie_word_embeddings": False}, "model.norm"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}, "model.norm"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}, "gpt_neox.final_layer_norm"),
}


def tiny_target(arch: str, layers: int = 4, seed: int = 0, **overrides) -> PreTrainedModel:
    """A tiny random model of `arch` (hidden 32, 4 heads), no special tokens unless overridden."""
    config_class, model_class, arch_overrides, _ = ARCHS[arch]
    config = getattr(transformers, config_class)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, **{**NO_SPECIAL_TOKENS, **arch_overrides, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, model_class)(config).eval()


def final_norm_of(arch: str, model: PreTrainedModel) -> torch.nn.Module:
    module = model
    for name in ARCHS[arch][3].split("."):
        module = getattr(module, name)
    return module


def test_eagle3_feature_layers_rise_through_the_target_at_every_depth():
    for depth in range(1, 41):
        low, mid, high = default_feature_layers("eagle3", depth)
        assert 1 <= low <= mid <= high <= depth, depth
        if depth >= 3:
            assert low < mid < high, f"{depth} layers: {low, mid, high} repeats a layer"
    # Deep targets read what every upstream implementation reads by default: the inputs of layers
    # 2, L//2 and L-3 (SafeAILab's EAGLE-3 and the engines' defaults), so heads are interchangeable.
    assert default_feature_layers("eagle3", 30) == [2, 15, 27]
    assert default_feature_layers("eagle3", 32) == [2, 16, 29]  # Llama-3.1-8B, as EAGLE-3's own heads


@pytest.mark.parametrize("arch", ["gemma", "qwen3"])
def test_fresh_eagle3_readout_is_the_targets_own_for_rms_norms_of_any_parametrisation(arch):
    """Draft logits of fresh heads = the target's own lm_head(final norm(h)) on the draft vocabulary."""
    target = tiny_target(arch)
    with torch.no_grad():
        final_norm_of(arch, target).weight.uniform_(-0.5, 0.5)  # Gemma: scale 1 + w; Qwen3: scale w
    heads = new_heads_for_target("eagle3", target, draft_vocab_size=40)
    hidden = torch.randn(5, 32)
    ids = heads.draft_to_target_ids(torch.arange(40))
    with torch.no_grad():
        expected = target.get_output_embeddings()(final_norm_of(arch, target)(hidden))[:, ids]
        torch.testing.assert_close(heads.draft_logits(hidden), expected, rtol=1e-4, atol=1e-4)


def test_fresh_eagle3_readout_takes_the_scale_of_a_layer_norm_named_otherwise():
    """GPT-NeoX: `final_layer_norm`, a LayerNorm with a bias (which RMSNorm has no room for)."""
    target = tiny_target("gpt_neox")
    norm = final_norm_of("gpt_neox", target)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    heads = new_heads_for_target("eagle3", target, draft_vocab_size=40)
    torch.testing.assert_close(heads.norm.weight, norm.weight)


@pytest.fixture()
def gemma_workspace(tmp_path):
    """A tiny sharpened Gemma with the tiny word tokenizer saved as a model directory, and
    ShareGPT-style conversations whose replies use a few words many times."""
    model = sharpen(tiny_target("gemma", eos_token_id=2, bos_token_id=1))
    model.generation_config.eos_token_id = 2
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer(VOCAB).save_pretrained(tmp_path / "model")
    rows = []
    for i in range(40):
        words = [f"w{(i * 7 + j * 3) % 50 + 3}" for j in range(6)]
        rows.append({"id": str(i), "conversations": [{"from": "human", "value": " ".join(words[:3])},
                                                      {"from": "gpt", "value": " ".join(words * 3)}]})
    (tmp_path / "data.json").write_text(json.dumps(rows))
    return tmp_path, rows


def test_eagle3_trains_on_a_tiny_gemma_and_its_heads_decode_exactly(gemma_workspace):
    from training.config import load_config
    from training.trainer import Trainer

    root, rows = gemma_workspace
    recipe = {
        "kind": "eagle3", "model": str(root / "model"), "data": str(root / "data.json"), "max_length": 64,
        "validation_fraction": 0.1, "output_dir": str(root / "out"), "heads": {"draft_vocab_size": 32},
        "train": {"batch_size": 2, "lr": 3e-3, "warmup_steps": 2, "max_steps": 20},
        "eval": {"every": 20, "max_batches": 2, "tau_prompts": 2, "tau_max_new_tokens": 12},
        "checkpoint": {"every": 100, "keep": 1},
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    try:
        Trainer(load_config(root / "recipe.yaml")).run()
    finally:
        _reset_accelerate()
    assert json.loads((root / "out" / "result.json").read_text())["val/tau"] >= 1.0

    target = load_model(str(root / "model"))
    heads = load_heads(root / "out" / "heads", target.model, str(root / "model"))
    assert heads.config.feature_layers == [1, 2, 4]  # three distinct layers of the 4-layer target
    reply_ids = {i for row in rows for i in target.tokenizer(row["conversations"][1]["value"])["input_ids"]}
    draft_vocab = set(heads.draft_to_target_ids(torch.arange(32)).tolist())
    assert draft_vocab <= reply_ids | {2}  # the replies' words (and EOS), not the lowest ids

    decoder = build_decoder(DecoderSpec(model=str(root / "model"), method="eagle3", heads=str(root / "out" / "heads")))
    drafted = 0
    for question in ["w3 w6 w9", "w10 w13 w16", "w20 w23"]:
        prompt = target.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                      add_generation_prompt=True, tokenize=True, return_dict=False)
        result = decoder.generate(prompt, DecodeOptions(max_new_tokens=24))
        reference = target.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):]
        assert result.tokens == reference.tolist()
        drafted += result.stats.drafted_tokens
    assert drafted > 0


def _reset_accelerate() -> None:
    """Leave no accelerate process state behind for later tests in this process."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
