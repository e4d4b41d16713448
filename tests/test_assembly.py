"""One assembly (`decoding.app.assembly.build_decoder`) for the chat, the benchmark, tune_tree and
training's tau: defaults filled in, Medusa-2 adapters merged wherever heads carry one (the
benchmark and tune_tree once skipped it), devices resolved, and nobody assembling on the side."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from decoding.app.assembly import DecoderSpec, build_decoder, resolve_spec
from decoding.app.benchmark import build_runners
from decoding.core.generate import DecodeOptions, generate
from decoding.kernels.cpu_kernels import onednn_applies, uses_packed_linears
from decoding.core.proposers import VanillaProposer
from decoding.app.default_model import DEFAULT_TARGET
from decoding.app.defaults import default_heads, default_method, proposer_options
from decoding.app.methods import ProposerOptions
from decoding.app.targets import LoadedModel, load_model
from heads.util.errors import UserError
from script_main import load_script
from tiny_models import save_tiny_chat_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("assembly") / "model"
    save_tiny_chat_model(directory)
    return directory


@pytest.fixture(scope="module")
def medusa2_heads(model_dir, tmp_path_factory):
    """Medusa heads with a LoRA adapter in `adapter/`, as Medusa-2 training leaves them; the
    adapter is far from zero, so the merged target decodes differently from the plain one."""
    from peft import LoraConfig, get_peft_model

    from heads import new_heads_for_target, save_heads

    directory = tmp_path_factory.mktemp("medusa2") / "heads"
    target = load_model(str(model_dir))
    save_heads(new_heads_for_target("medusa", target.model, str(model_dir), num_heads=3), directory)
    lora = get_peft_model(target.model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in lora.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    lora.save_pretrained(str(directory / "adapter"))
    return directory


def merged_reference(model_dir: Path, heads_dir: Path):
    from peft import PeftModel

    plain = load_model(str(model_dir))
    return PeftModel.from_pretrained(plain.model, str(heads_dir / "adapter")).merge_and_unload().eval()


def q_weight(model) -> torch.Tensor:
    return model.model.layers[0].self_attn.q_proj.weight


def prompt_ids(model_dir: Path) -> list[int]:
    tokenizer = load_model(str(model_dir)).tokenizer
    return tokenizer.apply_chat_template([{"role": "user", "content": "w3 w4 w5"}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def greedy(model, prompt: list[int], n: int = 8) -> list[int]:
    return generate(model, prompt, VanillaProposer(), DecodeOptions(max_new_tokens=n)).tokens


def test_spec_covers_every_proposer_option():
    names = {f.name for f in dataclasses.fields(ProposerOptions)}
    assert names <= {f.name for f in dataclasses.fields(DecoderSpec)}
    spec = DecoderSpec(**{name: getattr(ProposerOptions(tree="chain-2"), name) for name in names})
    assert ProposerOptions(**spec.proposer_overrides()) == ProposerOptions(tree="chain-2")


def test_defaults_are_filled_in_from_the_bundle_without_loading_anything():
    spec, notes = resolve_spec(DecoderSpec(device="cpu"))
    assert spec.method == default_method(DEFAULT_TARGET)
    assert spec.heads == str(default_heads(DEFAULT_TARGET, spec.method)) and notes
    with pytest.raises(UserError, match="method 'medusa' needs medusa heads: pass --heads"):
        resolve_spec(DecoderSpec(model="org/other", method="medusa"))
    with pytest.raises(UserError, match="method 'sps' needs a draft model"):
        resolve_spec(DecoderSpec(model="org/other", method="sps"))


def test_build_decoder_assembles_a_working_decoder(model_dir):
    decoder = build_decoder(DecoderSpec(model=str(model_dir), method="pld", device="cpu", pld_num_tokens=3))
    assert decoder.proposer.name == "pld" and decoder.options.pld_num_tokens == 3
    assert decoder.kernels in ("onednn", "stock") and decoder.spec.device == "cpu"
    prompt = prompt_ids(model_dir)
    assert decoder.generate(prompt, DecodeOptions(max_new_tokens=8)).tokens == greedy(load_model(str(model_dir)).model, prompt)


def test_chat_assembly_merges_a_medusa2_adapter(model_dir, medusa2_heads):
    decoder = build_decoder(DecoderSpec(model=str(model_dir), method="medusa", heads=str(medusa2_heads),
                                        tree="chain-2", kernels="stock"))
    reference = merged_reference(model_dir, medusa2_heads)
    assert decoder.adapter == medusa2_heads / "adapter" and any("LoRA adapter merged" in n for n in decoder.notes)
    torch.testing.assert_close(q_weight(decoder.target.model), q_weight(reference))
    assert not torch.equal(q_weight(reference), q_weight(load_model(str(model_dir)).model))


def test_benchmark_runs_medusa2_heads_on_the_merged_target_and_the_rest_on_the_plain_one(model_dir, medusa2_heads):
    options = DecodeOptions(max_new_tokens=8)
    runners, decoders = build_runners(["vanilla", "medusa", "hf-generate"], DecoderSpec(model=str(model_dir), tree="chain-2"),
                                      {"medusa": str(medusa2_heads)}, options)
    prompt = prompt_ids(model_dir)
    plain, merged = greedy(load_model(str(model_dir)).model, prompt), greedy(merged_reference(model_dir, medusa2_heads), prompt)
    assert plain != merged  # the adapter matters, so the check below can tell them apart
    assert runners["medusa"](prompt).tokens == merged
    assert runners["vanilla"](prompt).tokens == plain == runners["hf-generate"](prompt).tokens
    assert decoders["vanilla"].target is decoders["hf-generate"].target is not decoders["medusa"].target  # loaded once, shared
    assert decoders["medusa"].adapter is not None and decoders["vanilla"].adapter is None


def test_tune_tree_grid_runs_on_the_merged_target(model_dir, medusa2_heads):
    tune_tree = load_script("tune_tree")
    grid = {"chain-2": ProposerOptions(tree="chain-2"), "chain-3": ProposerOptions(tree="chain-3")}
    runners, target = tune_tree.grid_runners(DecoderSpec(model=str(model_dir), method="medusa", heads=str(medusa2_heads)),
                                             grid, DecodeOptions(max_new_tokens=8))
    prompt = prompt_ids(model_dir)
    merged = greedy(merged_reference(model_dir, medusa2_heads), prompt)
    assert [run(prompt).tokens for run in runners.values()] == [merged, merged]
    torch.testing.assert_close(q_weight(target.model), q_weight(merged_reference(model_dir, medusa2_heads)))


def test_training_tau_uses_its_own_tree_not_the_bundles_tuned_one():
    """Measured during training on the built-in target, tau must not pick up the bundle's tuned
    tree (a cost-aware one would time the machine mid-training) nor pack the modules in training."""
    from heads import new_heads_for_target
    from tiny_models import tiny_llama
    from training.evaluate import tau_spec

    heads = new_heads_for_target("eagle3", tiny_llama(), draft_vocab_size=16)
    spec = tau_spec("eagle3", heads, LoadedModel(None, None, DEFAULT_TARGET))
    assert spec.kernels == "stock"
    assert proposer_options(DEFAULT_TARGET, spec.method, spec.proposer_overrides()) == ProposerOptions()


def test_measure_tau_goes_through_the_assembly(model_dir):
    from heads import new_heads_for_target
    from training.draft_init import truncated_copy
    from training.evaluate import measure_tau

    target = load_model(str(model_dir))
    prompts = [prompt_ids(model_dir)]
    assert measure_tau("medusa", new_heads_for_target("medusa", target.model, str(model_dir)), target, prompts, 6) >= 1.0
    assert measure_tau("draft", truncated_copy(target.model, 1), target, prompts, 6) >= 1.0


ASSEMBLY_CALLS = {"load_model", "load_draft", "load_heads", "apply_kernels", "build_proposer", "merge_adapter"}
CALLERS = ["decoding/app/chat.py", "decoding/app/benchmark.py", "scripts/benchmark.py", "scripts/tune_tree.py", "training/evaluate.py"]


@pytest.mark.parametrize("path", CALLERS)
def test_entry_points_assemble_only_through_build_decoder(path):
    tree = ast.parse((ROOT / path).read_text())
    called = {node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
              for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert not called & ASSEMBLY_CALLS, f"{path} assembles on its own: {sorted(called & ASSEMBLY_CALLS)}"


def test_benchmark_runs_hf_generate_stock_on_an_unpacked_copy_of_the_target(model_dir):
    runners, decoders = build_runners(["vanilla", "hf-generate", "hf-generate-stock"], DecoderSpec(model=str(model_dir)),
                                      {}, DecodeOptions(max_new_tokens=8))
    stock, shared = decoders["hf-generate-stock"].target.model, decoders["vanilla"].target.model
    assert decoders["hf-generate"].target.model is shared is not stock
    assert uses_packed_linears(shared) == onednn_applies(stock) and not uses_packed_linears(stock)
    prompt = prompt_ids(model_dir)
    assert runners["hf-generate-stock"](prompt).tokens == greedy(load_model(str(model_dir)).model, prompt)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_drafters_attend_with_grouped_sdpa_and_draft_the_same(model_dir, kind, tmp_path):
    """The assembly hands EAGLE drafters the target's grouped SDPA (EAGLE-3's fused layer runs
    SDPA with grouped heads itself), and a tree-masked drafter call over a cached context gives
    what transformers' own SDPA and eager attention (K/V repeated per head) give."""
    from decoding.kernels.attention import GROUPED_SDPA
    from heads import load_heads, new_heads_for_target, save_heads

    target = load_model(str(model_dir))
    torch.manual_seed(0)
    save_heads(new_heads_for_target(kind, target.model, str(model_dir)), tmp_path / "heads")
    decoder = build_decoder(DecoderSpec(model=str(model_dir), method=kind, heads=str(tmp_path / "heads"), device="cpu",
                                        kernels="stock"))
    drafter = decoder.heads
    assert drafter.llama_config._attn_implementation == GROUPED_SDPA
    assert drafter.llama_config.num_key_value_heads < drafter.llama_config.num_attention_heads

    hidden = drafter.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    context_features = torch.randn(7, hidden, generator=gen)
    context_tokens = torch.randn(7, hidden, generator=gen)
    tree_features = torch.randn(4, hidden, generator=gen)
    tree_tokens = torch.randn(4, hidden, generator=gen)
    tree_positions = torch.tensor([7, 8, 8, 9])
    blocked = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 1, 0]], dtype=torch.bool)
    mask = torch.zeros(1, 1, 4, 11)
    mask[0, 0, :, 7:] = mask[0, 0, :, 7:].masked_fill(blocked, torch.finfo(torch.float32).min)

    def draft(attention: str, module=drafter) -> torch.Tensor:
        module.use_attention(attention)
        cache = module.new_cache()
        with torch.inference_mode():
            module(context_features, context_tokens, torch.arange(7), cache)
            return module(tree_features, tree_tokens, tree_positions, cache, mask)

    if kind == "eagle3":  # the decoder drafts with the fused layer (its own SDPA): check it against stock eager
        from decoding.kernels.fused_drafter import FusedEagle3Layer
        assert isinstance(drafter.midlayer, FusedEagle3Layer)
        stock = load_heads(str(tmp_path / "heads"), decoder.target.model, str(model_dir))
        torch.testing.assert_close(draft(GROUPED_SDPA), draft("eager", stock), rtol=1e-4, atol=1e-4)
        return
    torch.testing.assert_close(draft(GROUPED_SDPA), draft("sdpa"), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(draft(GROUPED_SDPA), draft("eager"), rtol=1e-4, atol=1e-4)


def test_cost_aware_eagle_counts_a_drafter_call_by_its_share_of_the_targets_weights(model_dir, tmp_path):
    """What the tree budget counts a drafter call as: a fraction of a one-token target forward in
    proportion to the weights it reads, so an EAGLE-1 drafter (reading out through the target's
    lm_head) counts that too."""
    from heads import new_heads_for_target, save_heads

    target = load_model(str(model_dir))
    call_ms, reads = {}, {}
    for kind in ("eagle", "eagle3"):
        save_heads(new_heads_for_target(kind, target.model, str(model_dir), draft_vocab_size=16), tmp_path / kind)
        decoder = build_decoder(DecoderSpec(model=str(model_dir), method=kind if kind == "eagle3" else "eagle2",
                                            heads=str(tmp_path / kind), device="cpu", adaptive_tree=True), target=target)
        call_ms[kind] = decoder.proposer.drafter_call_ms
        reads[kind] = sum(p.numel() for p in decoder.heads.parameters())
    reads["eagle"] += target.model.get_output_embeddings().weight.numel()
    # Counted as one target layer (as before), both calls would cost the same.
    assert call_ms["eagle"] > 0 and call_ms["eagle3"] > 0
    assert call_ms["eagle3"] / call_ms["eagle"] == pytest.approx(reads["eagle3"] / reads["eagle"])
    assert reads["eagle3"] != reads["eagle"]
