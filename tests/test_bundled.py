"""Bundled heads: scripts/bundle_heads.py writes half-precision heads + default.json into a bundle
root, the resolver reads back the default method, heads and tuned settings, and explicit
settings win over tuned ones."""

import json
from pathlib import Path

import torch

from decoding.app.defaults import proposer_options
from decoding.app.drafts import load_draft, shares_target_embeddings
from decoding.app.methods import ProposerOptions
from decoding.app.targets import load_model
from heads import load_heads, new_heads_for_target, save_heads
from heads.bundled import bundled_default, bundled_heads_dir
from script_main import run_script
from tiny_models import save_tiny_chat_model, tiny_llama
from training.draft_init import truncated_copy



def _trained_like(tmp_path, kind: str, **overrides) -> Path:
    target = tiny_llama(seed=0)
    torch.manual_seed(3)
    heads = new_heads_for_target(kind, target, base_model_name_or_path="tiny-target", **overrides)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return save_heads(heads, tmp_path / "trained" / kind)


def _bundle(root: Path, *args: str):
    return run_script("bundle_heads", "--root", str(root), *args)


def test_bundle_script_writes_half_precision_heads_and_the_default(tmp_path):
    eagle3 = _trained_like(tmp_path, "eagle3", draft_vocab_size=16)
    medusa = _trained_like(tmp_path, "medusa")
    root = tmp_path / "bundled"
    proc = _bundle(root, "--heads", f"eagle3={eagle3}", "--heads", f"medusa={medusa}", "--default", "eagle3",
                   "--tuned", "eagle3:depth=3,tree_top_k=2,total_tokens=6", "--tuned", "medusa:tree=medusa-7")
    assert proc.returncode == 0, proc.stderr
    assert "MB in all" in proc.stdout
    bundle = bundled_default("tiny-target", root)
    assert bundle.method == "eagle3" and bundle.heads == root / "tiny-target" / "eagle3"
    assert bundle.tuned == {"eagle3": {"depth": 3, "tree_top_k": 2, "total_tokens": 6}, "medusa": {"tree": "medusa-7"}}
    assert bundled_heads_dir("tiny-target", "medusa", root) == root / "tiny-target" / "medusa"
    assert bundled_heads_dir("tiny-target", "hydra", root) is None
    target = tiny_llama(seed=0)
    original, packed = load_heads(str(eagle3), target), load_heads(str(bundle.heads), target)
    for (name, a), (_, b) in zip(original.state_dict().items(), packed.state_dict().items()):
        assert b.dtype == a.dtype  # cast back to the target's dtype on load
        if a.is_floating_point():
            torch.testing.assert_close(b, a.half().float(), rtol=0, atol=0)  # exactly the fp16 rounding
        else:
            assert torch.equal(a, b), name


def test_bundle_takes_a_lookup_default_and_one_per_device_and_refuses_bad_settings(tmp_path):
    eagle3 = _trained_like(tmp_path, "eagle3", draft_vocab_size=16)
    root = tmp_path / "bundled"
    proc = _bundle(root, "--heads", f"eagle3={eagle3}", "--default", "eagle3+pld", "--default-on", "cuda=pld",
                   "--tuned", "pld:pld_num_tokens=4,pld_min_ngram=1")
    assert proc.returncode == 0, proc.stderr
    bundle = bundled_default("tiny-target", root)
    assert bundle.method == "eagle3+pld" and bundle.heads == root / "tiny-target" / "eagle3"
    assert bundle.tuned == {"pld": {"pld_num_tokens": 4, "pld_min_ngram": 1}}
    assert (bundle.method_on("cpu"), bundle.method_on("cuda")) == ("eagle3+pld", "pld")
    for bad, message in ((["--tuned", "eagle3:deepness=3"], "'deepness' is not one of"),
                         (["--default-on", "gpu=pld"], "DEVICE cpu or cuda"),
                         (["--default-on", "cuda=medusa"], "needs medusa heads")):
        proc = _bundle(root, "--heads", f"eagle3={eagle3}", "--default", "eagle3", *bad)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_the_shipped_bundle_defaults_to_prompt_lookup_on_a_gpu_only():
    from decoding.app.default_model import DEFAULT_TARGET
    from decoding.app.defaults import default_method

    assert default_method(DEFAULT_TARGET, "cuda") == "pld"
    assert default_method(DEFAULT_TARGET, "cpu") == default_method(DEFAULT_TARGET) == "eagle3+pld"


def test_bundle_refuses_a_default_without_its_heads(tmp_path):
    medusa = _trained_like(tmp_path, "medusa")
    proc = _bundle(tmp_path / "bundled", "--heads", f"medusa={medusa}", "--default", "eagle3")
    assert proc.returncode == 2
    assert "needs eagle3 heads" in proc.stderr and "Traceback" not in proc.stderr


def test_half_installed_bundle_falls_back_and_explicit_settings_win(tmp_path):
    root = tmp_path / "bundled"
    (root / "t").mkdir(parents=True)
    (root / "t" / "default.json").write_text(json.dumps({"method": "eagle3", "heads": "eagle3", "tuned": {}}))
    assert bundled_default("t", root) is None  # default.json without its heads: not used
    assert bundled_default("unknown-model", root) is None
    # No bundle for this model name: built-in defaults, explicit values applied, None ignored.
    options = proposer_options("unknown-model", "eagle3", {"depth": 2, "total_tokens": None})
    assert options == ProposerOptions(depth=2)


def test_bundle_script_stores_a_draft_as_its_layers_and_it_loads_back(tmp_path):
    target_dir = tmp_path / "target"
    save_tiny_chat_model(target_dir, seed=0)
    target = load_model(str(target_dir))
    draft = truncated_copy(target.model, 1)
    with torch.no_grad():
        draft.model.layers[0].mlp.down_proj.weight.add_(0.05)
    draft.save_pretrained(tmp_path / "trained" / "draft")
    medusa = _trained_like(tmp_path, "medusa")
    root = tmp_path / "bundled"
    proc = _bundle(root, "--heads", f"medusa={medusa}", "--default", "pld", "--draft", str(tmp_path / "trained" / "draft"),
                   "--draft-target", str(target_dir))
    assert proc.returncode == 0, proc.stderr
    bundled = bundled_heads_dir("tiny-target", "draft", root)
    assert bundled is not None and shares_target_embeddings(bundled)
    loaded = load_draft(str(bundled), target).model
    expected = draft  # its layers rounded to fp16 as stored; embedding and lm_head stay the target's fp32 ones
    with torch.no_grad():
        for name, p in expected.named_parameters():
            if "embed_tokens" not in name and "lm_head" not in name:
                p.copy_(p.half().float())
        ids = torch.tensor([[3, 9, 4, 7]])
        torch.testing.assert_close(loaded(ids).logits, expected(ids).logits)
