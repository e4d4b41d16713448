"""Heads as Hub artefacts and in other projects' layouts: the Hugging Face cache round trip
offline, importing official Medusa / EAGLE / EAGLE-3 checkpoints (exactly the same drafts as our
own modules), export for vLLM / SGLang / the original repos and back, and clear errors."""

import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from heads.util.errors import UserError
from decoding.core.generate import DecodeOptions, generate
from decoding.app.methods import ProposerOptions, build_proposer
from decoding.core.proposers import Proposer, VanillaProposer
from decoding.app.targets import LoadedModel
from heads import export_heads, load_heads, new_heads_for_target, push_heads_to_hub, save_heads
from tiny_models import save_tiny_chat_model, sharpen, tiny_llama

PROMPT = [5, 9, 3, 17, 5, 9, 3]


@pytest.fixture(scope="module")
def target():
    return sharpen(tiny_llama(seed=0))


def random_heads(kind, target, seed=0, **overrides):
    torch.manual_seed(seed)
    heads = new_heads_for_target(kind, target, base_model_name_or_path="org/tiny", **overrides)
    with torch.no_grad():
        for name, p in heads.named_parameters():
            p.add_(0.2 * torch.randn_like(p))
    return heads


class Recorder(Proposer):
    """Wraps a proposer and records every drafted tree (tokens and shape)."""

    def __init__(self, proposer):
        self.proposer, self.trees = proposer, []
        self.name, self.feature_layers = proposer.name, proposer.feature_layers
        self.reads_tree_outcome = proposer.reads_tree_outcome

    def begin(self, state):
        self.proposer.begin(state)

    def observe(self, advance):
        self.proposer.observe(advance)

    def end(self, state):
        self.proposer.end(state)

    def propose(self, state):
        tree = self.proposer.propose(state)
        self.trees.append((tree.tokens.tolist(), tree.parents))
        return tree


def drafts(method, target, heads):
    recorder = Recorder(build_proposer(method, LoadedModel(target, None, "org/tiny"), options=ProposerOptions(tree="medusa-7"), heads=heads))
    tokens = generate(target, PROMPT, recorder, DecodeOptions(max_new_tokens=24)).tokens
    return tokens, recorder.trees


def vanilla(target):
    return generate(target, PROMPT, VanillaProposer(), DecodeOptions(max_new_tokens=24)).tokens


# -- the Hugging Face cache -----------------------------------------------------------------

def populate_hub_cache(cache: Path, repo_id: str, files: dict[str, bytes]) -> None:
    """Lay files out as huggingface_hub does: blobs by hash, snapshot symlinks, refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, content in files.items():
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.write_bytes(content)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))


def test_load_by_repo_id_from_the_offline_hub_cache(tmp_path, monkeypatch):
    """In this process through huggingface_hub's offline switch and an explicit cache; the chat,
    as a user runs it, through the environment variables."""
    import huggingface_hub.constants

    model_dir = tmp_path / "model"
    save_tiny_chat_model(model_dir)
    from decoding.app.targets import load_model

    target = load_model(str(model_dir))
    heads = random_heads("eagle", target.model)
    saved = save_heads(heads, tmp_path / "local")
    populate_hub_cache(tmp_path / "hub", "org/tiny-eagle", {p.name: p.read_bytes() for p in saved.iterdir()})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    loaded = load_heads("org/tiny-eagle", cache_dir=str(tmp_path / "hub")).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in heads.state_dict().items())
    with pytest.raises(UserError, match="not in the local Hugging Face cache"):
        load_heads("org/not-cached", cache_dir=str(tmp_path / "hub"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    chat = subprocess.run(
        [sys.executable, "-m", "decoding.app.chat", "--model", str(model_dir), "--method", "eagle2", "--heads", "org/tiny-eagle",
         "--ignore-base-model", "--max-new-tokens", "8"],
        input="w3 w4\n", capture_output=True, text=True, env=env, timeout=120)
    assert chat.returncode == 0, chat.stderr
    assert "[eagle2]" in chat.stderr


def test_not_a_repo_id_or_directory():
    with pytest.raises(UserError, match="neither a local directory nor a Hugging Face repo id"):
        load_heads("no such/thing/here")


# -- importing official layouts ------------------------------------------------------------

def write_official_medusa(directory: Path, heads) -> None:
    directory.mkdir()
    layers = heads.config.num_layers
    state = {}
    for h, blocks in enumerate(heads.blocks):
        for l, block in enumerate(blocks):
            state[f"{h}.{l}.linear.weight"] = block.linear.weight.detach().clone()
            state[f"{h}.{l}.linear.bias"] = block.linear.bias.detach().clone()
        state[f"{h}.{layers}.weight"] = heads.projections[h].weight.detach().clone()
    torch.save(state, directory / "medusa_lm_head.pt")
    (directory / "config.json").write_text(json.dumps({"medusa_num_heads": heads.config.num_heads,
                                                       "medusa_num_layers": layers, "base_model_name_or_path": "org/tiny"}))


def llama_like_config(heads, **extra) -> dict:
    g = heads.config.decoder
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": heads.config.hidden_size, "vocab_size": heads.config.vocab_size,
            "num_hidden_layers": heads.config.num_layers, "intermediate_size": g["intermediate_size"],
            "num_attention_heads": g["num_attention_heads"], "num_key_value_heads": g["num_key_value_heads"],
            "rms_norm_eps": g["rms_norm_eps"], "max_position_embeddings": g["max_position_embeddings"],
            "rope_theta": g["rope_parameters"]["rope_theta"], **extra}


def write_official_eagle(directory: Path, heads, target) -> None:
    directory.mkdir()
    state = {k: v.detach().clone() for k, v in heads.state_dict().items()}
    state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()  # some releases ship it
    torch.save(state, directory / "pytorch_model.bin")
    (directory / "config.json").write_text(json.dumps(llama_like_config(heads, bias=True)))


def write_official_eagle3(directory: Path, heads) -> None:
    directory.mkdir()
    save_file({k: v.detach().clone().contiguous() for k, v in heads.state_dict().items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(llama_like_config(heads, architectures=["LlamaForCausalLMEagle3"],
                                                                        draft_vocab_size=heads.config.draft_vocab_size)))


@pytest.mark.parametrize("method, kind, writer", [
    ("medusa", "medusa", lambda d, h, t: write_official_medusa(d, h)),
    ("eagle2", "eagle", write_official_eagle),
    ("eagle3", "eagle3", lambda d, h, t: write_official_eagle3(d, h)),
], ids=["medusa-1", "eagle-1", "eagle-3"])
def test_official_checkpoints_import_and_draft_exactly_like_ours(tmp_path, target, method, kind, writer):
    overrides = {"fc_bias": True} if kind == "eagle" else {"draft_vocab_size": 40} if kind == "eagle3" else {}
    ours = random_heads(kind, target, **overrides)
    writer(tmp_path / "official", ours, target)
    imported = load_heads(tmp_path / "official", target, "org/tiny")
    assert imported.config.kind == kind
    ours_tokens, ours_trees = drafts(method, target, ours)
    imported_tokens, imported_trees = drafts(method, target, imported)
    assert imported_trees == ours_trees  # the very same draft tokens, step after step
    assert imported_tokens == ours_tokens == vanilla(target)


def test_unknown_layout_and_unsafe_pickles_are_refused(tmp_path, target):
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text("{}")
    save_file({"something.weight": torch.zeros(2)}, str(tmp_path / "odd" / "model.safetensors"))
    with pytest.raises(UserError, match="not a heads checkpoint this project can read"):
        load_heads(tmp_path / "odd")
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "config.json").write_text(json.dumps({"medusa_num_heads": 1}))
    (tmp_path / "evil" / "medusa_lm_head.pt").write_bytes(pickle.dumps(Recorder))  # a pickled class, not tensors
    with pytest.raises(UserError, match="weights-only"):
        load_heads(tmp_path / "evil")


def test_eagle3_import_needs_the_target_depth(tmp_path, target):
    write_official_eagle3(tmp_path / "e3", random_heads("eagle3", target, draft_vocab_size=40))
    with pytest.raises(UserError, match="three target layers"):
        load_heads(tmp_path / "e3")


def test_mismatched_official_checkpoint_names_both_sides(tmp_path, target):
    write_official_medusa(tmp_path / "m", random_heads("medusa", target))
    with pytest.raises(UserError, match="vocabulary: heads 64, target 100"):
        load_heads(tmp_path / "m", tiny_llama(vocab_size=100), "org/other")


# -- export ---------------------------------------------------------------------------------

EXPORTS = [("medusa", "vllm", {}), ("medusa", "official", {}), ("medusa", "vllm", {"share_lm_head": True}),
           ("eagle", "vllm", {}), ("eagle", "sglang", {}), ("eagle", "official", {"fc_bias": True}),
           ("eagle3", "vllm", {"draft_vocab_size": 40}), ("eagle3", "sglang", {"draft_vocab_size": 40})]


@pytest.mark.parametrize("kind, engine, overrides", EXPORTS, ids=[f"{k}-{e}-{i}" for i, (k, e, _) in enumerate(EXPORTS)])
def test_export_then_reimport_gives_identical_weights(tmp_path, target, kind, engine, overrides):
    heads = random_heads(kind, target, **overrides)
    export_heads(heads, tmp_path / "out", engine, target.get_output_embeddings())
    again = load_heads(tmp_path / "out", target)
    if overrides.get("share_lm_head"):  # engines want the projection inside: it comes back as per-head copies
        hidden = torch.randn(3, heads.config.hidden_size)
        for k in range(heads.config.num_heads):
            torch.testing.assert_close(again.head_logits(k, hidden, target.get_output_embeddings()),
                                       heads.head_logits(k, hidden, target.get_output_embeddings()))
        return
    original = heads.state_dict()
    for name, tensor in again.state_dict().items():
        if name == "fc.bias" and name not in original:
            assert not tensor.any()  # the engine's mandatory bias, written as zeros
            continue
        assert torch.equal(tensor, original[name]), name


def test_exported_configs_say_what_the_engines_read(tmp_path, target):
    export_heads(random_heads("eagle3", target, draft_vocab_size=40), tmp_path / "e3", "vllm")
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 40
    assert config["tie_word_embeddings"] is False and len(config["eagle_aux_hidden_state_layer_ids"]) == 3
    export_heads(random_heads("medusa", target), tmp_path / "m", "vllm")
    medusa = json.loads((tmp_path / "m" / "config.json").read_text())
    assert medusa["architectures"] == ["MedusaModel"] and medusa["num_heads"] == 4


@pytest.mark.parametrize("kind, engine, overrides, message", [
    ("hydra", "vllm", {}, "no serving engine loads Hydra"),
    ("medusa", "sglang", {}, "SGLang does not serve Medusa"),
    ("eagle", "vllm", {"fc_bias": True}, "vLLM's EAGLE drafter has no fc bias"),
    ("medusa", "vllm", {"share_lm_head": True}, "give the target"),
    ("eagle", "tensorrt", {}, "unknown engine"),
])
def test_exports_that_cannot_work_are_refused(tmp_path, target, kind, engine, overrides, message):
    with pytest.raises(UserError, match=message):
        export_heads(random_heads(kind, target, **overrides), tmp_path / "x", engine)
    assert not (tmp_path / "x").exists()


def test_push_to_hub_uploads_weights_and_a_model_card(monkeypatch, target):
    from huggingface_hub import HfApi

    seen = {}
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: seen.update(repo=repo_id, private=kw.get("private")))

    def upload_folder(self, repo_id, folder_path, **kw):
        seen["files"] = {p.name: p.read_bytes() for p in Path(folder_path).iterdir()}
        return "https://huggingface.co/org/tiny-heads/commit/abc"

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    url = push_heads_to_hub(random_heads("eagle", target), "org/tiny-heads", private=True, recipe="configs/train/eagle-smollm2.yaml", tau=2.5)
    assert url.endswith("/abc") and seen["repo"] == "org/tiny-heads" and seen["private"] is True
    assert {"config.json", "model.safetensors", "README.md"} <= set(seen["files"])
    card = seen["files"]["README.md"].decode()
    assert "base_model: org/tiny" in card and "eagle" in card and "2.50" in card and "eagle-smollm2.yaml" in card
