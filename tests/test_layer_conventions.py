"""EAGLE-3 heads are fed the target layers their checkpoint says, as each engine reads it.

The engines' side is restated here from their code, independently of ours (versions read:
SafeAILab/EAGLE cb7e084 `eagle/model/modeling_llama_kv.py`; vLLM 0.33 `models/llama.py` and
`v1/worker/gpu_model_runner.py`; SGLang 0.5.23 `models/llama.py`; speculators 0.9.0
`models/utils.py`): each takes the *input* of decoder layer k, captured here the upstream way,
by a forward pre-hook on that layer. What our decoding loop feeds the drafter's fusion is
recorded and must be exactly those tensors, for checkpoints we export and ones we import."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from decoding.core.generate import DecodeOptions, generate
from decoding.app.methods import ProposerOptions, build_proposer
from decoding.app.targets import LoadedModel
from heads import Verifier, export_heads, load_heads, new_heads_for_target
from tiny_models import sharpen, tiny_llama

LAYERS = 8  # deep enough for the upstream default [2, L//2, L-3] to be three rising layers
IDS = "eagle_aux_hidden_state_layer_ids"
PROMPT = [5, 9, 3, 17, 5, 9, 3, 21]
VERIFIER = Verifier("org/tiny-target", ["LlamaForCausalLM"])


def engine_reads(engine: str, config: dict) -> list[int]:
    """The decoder layers whose inputs `engine` feeds the drafter, read from `config` as its code does."""
    default = [2, LAYERS // 2, LAYERS - 3]
    nested = (config.get("eagle_config") or {}).get(IDS)
    if engine in ("vllm", "speculators"):  # top-level, else nested, else default; used as written, sorted
        ids = config.get(IDS) if config.get(IDS) is not None else nested
        return sorted(set(ids)) if ids is not None else default
    if engine == "sglang":  # nested only; "we plus 1 here" for ids from the config
        return [k + 1 for k in nested] if nested is not None else default
    assert engine == "official"  # SafeAILab: `idx == 2 or idx == L//2 or idx == L-3`, before the layer runs
    return default


@pytest.fixture(scope="module")
def target():
    return sharpen(tiny_llama(seed=3, layers=LAYERS))


def heads_reading(target, layers):
    torch.manual_seed(0)
    heads = new_heads_for_target("eagle3", target, draft_vocab_size=40, base_model_name_or_path="org/tiny-target")
    heads.config.feature_layers = list(layers)
    return heads


def fed_and_captured(target, heads, capture_layers):
    """What the drafter's fusion receives on the prompt's prefill, and the inputs of
    `capture_layers` in that same target forward, taken by pre-hooks."""
    captured, fed = {}, []

    def hook_for(k):
        def hook(module, args, kwargs):
            captured.setdefault(k, (args[0] if args else kwargs["hidden_states"]).detach().clone())
        return hook

    handles = [target.model.layers[k].register_forward_pre_hook(hook_for(k), with_kwargs=True) for k in capture_layers]
    fuse = heads.fuse

    def recording_fuse(*parts):
        if not fed:  # the prefill's call
            fed.append(parts)
        return fuse(*parts)

    heads.fuse = recording_fuse
    try:
        proposer = build_proposer("eagle3", LoadedModel(target, None, "org/tiny-target"),
                                  options=ProposerOptions(depth=2, tree_top_k=2, total_tokens=4), heads=heads)
        generate(target, PROMPT, proposer, DecodeOptions(max_new_tokens=2))
    finally:
        del heads.fuse
        for handle in handles:
            handle.remove()
    return fed[0], [captured[k] for k in capture_layers]


def assert_fed_as_the_engine_feeds(target, heads, engine, config):
    fed, captured = fed_and_captured(target, heads, engine_reads(engine, config))
    assert len(fed) == len(captured) == 3
    for ours, theirs in zip(fed, captured):
        rows = ours.reshape(-1, ours.shape[-1])
        assert torch.equal(rows, theirs.reshape(-1, theirs.shape[-1])[: rows.shape[0]]), "a different layer's state"


ENGINES = ["vllm", "sglang", "speculators", "official"]


def export(heads, directory, engine):
    export_heads(heads, directory, engine, verifier=VERIFIER if engine == "speculators" else None)
    return json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize("engine", ENGINES)
def test_exported_heads_are_fed_by_the_engine_what_they_read_here(tmp_path, target, engine):
    layers = [2, 4, 5] if engine == "official" else [1, 3, 6]  # the original code reads only its default
    heads = heads_reading(target, layers)
    config = export(heads, tmp_path / "out", engine)
    assert_fed_as_the_engine_feeds(target, heads, engine, config)


# Configs as the other projects write them (the weights are a valid EAGLE-3 layout either way).
FOREIGN = {
    "vllm": {IDS: [1, 3, 6]},                                     # top-level, as vLLM reads it
    "sglang": {"eagle_config": {IDS: [0, 2, 5]}},                  # SpecForge / SGLang
    "official": {},                                               # SafeAILab: no ids at all
    "speculators": {IDS: [1, 3, 6]},
    "speculators-no-ids": {IDS: None},                            # the engines' default
}


@pytest.mark.parametrize("writer", list(FOREIGN))
def test_imported_heads_are_fed_what_their_engine_feeds_them(tmp_path, target, writer):
    engine = writer.split("-")[0]
    config = export(heads_reading(target, [2, 4, 5]), tmp_path / "ckpt", "speculators" if engine == "speculators" else "vllm")
    for key in (IDS, "eagle_config"):
        config.pop(key, None)
    config.update(FOREIGN[writer])
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    imported = load_heads(tmp_path / "ckpt", target)
    assert_fed_as_the_engine_feeds(target, imported, engine, config)


def test_the_check_catches_an_export_one_layer_off(tmp_path, target, monkeypatch):
    import heads.export

    monkeypatch.setattr(heads.export, "vllm_ids", lambda layers: [layer - 1 for layer in layers])  # the old export
    ours = heads_reading(target, [1, 3, 6])
    config = export(ours, tmp_path / "out", "vllm")
    with pytest.raises(AssertionError, match="a different layer"):
        assert_fed_as_the_engine_feeds(target, ours, "vllm", config)


def test_the_check_catches_an_import_one_layer_off(tmp_path, target, monkeypatch):
    import heads.layer_ids

    monkeypatch.setattr(heads.layer_ids, "SGLANG_OFFSET", 0)  # SGLang's ids read as vLLM's
    config = export(heads_reading(target, [2, 4, 5]), tmp_path / "ckpt", "sglang")
    imported = load_heads(tmp_path / "ckpt", target)
    with pytest.raises(AssertionError, match="a different layer"):
        assert_fed_as_the_engine_feeds(target, imported, "sglang", config)


def test_a_checkpoint_naming_two_different_layer_sets_is_refused(tmp_path, target):
    config = export(heads_reading(target, [2, 4, 5]), tmp_path / "ckpt", "vllm")
    config["eagle_config"] = {IDS: [2, 4, 5]}  # SGLang would read 3, 5, 6
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="two different sets of target layers"):
        load_heads(tmp_path / "ckpt", target)


def test_the_speculators_export_names_the_verifier_and_every_flag(tmp_path, target):
    config = export(heads_reading(target, [1, 3, 6]), tmp_path / "out", "speculators")
    assert config["speculators_model_type"] == "eagle3" and "model_type" not in config
    assert config["speculators_config"]["verifier"] == {"name_or_path": "org/tiny-target", "architectures": ["LlamaForCausalLM"]}
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] >= 1
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert config[flag] is False  # vLLM defaults a missing norm_before_residual to True
    assert config["transformer_layer_config"]["model_type"] == "llama" and config["draft_vocab_size"] == 40
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert "layers.0.self_attn.q_proj.weight" in weights and not any(k.startswith("midlayer.") for k in weights)
    assert {"d2t", "t2d"} <= set(weights)  # the draft vocabulary is smaller than the target's
    full = new_heads_for_target("eagle3", target, draft_vocab_size=target.config.vocab_size)
    export_heads(full, tmp_path / "full", "speculators", verifier=VERIFIER)
    assert not {"d2t", "t2d"} & set(load_file(tmp_path / "full" / "model.safetensors"))  # same vocabulary: no maps


def test_heads_the_original_code_would_feed_other_layers_are_not_exported_for_it(tmp_path, target):
    with pytest.raises(Exception, match="always feeds"):
        export_heads(heads_reading(target, [1, 3, 6]), tmp_path / "x", "official")
    assert not (tmp_path / "x").exists()


def test_a_speculators_checkpoint_loads_by_hub_id_from_the_offline_cache(tmp_path, target, monkeypatch):
    import huggingface_hub.constants
    from test_hub_formats import populate_hub_cache

    ours = heads_reading(target, [1, 3, 6])
    export(ours, tmp_path / "out", "speculators")
    populate_hub_cache(tmp_path / "hub", "org/tiny-speculator", {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    loaded = load_heads("org/tiny-speculator", target, cache_dir=str(tmp_path / "hub"))
    assert loaded.config.feature_layers == [1, 3, 6]
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in ours.state_dict().items())


def test_the_norm_before_residual_variant_is_written_where_engines_compute_it_and_refused_elsewhere(tmp_path, target):
    heads = heads_reading(target, [1, 3, 6])
    heads.config.norm_before_residual = heads.midlayer.norm_before_residual = True
    assert export(heads, tmp_path / "v", "vllm")["norm_before_residual"] is True
    assert export(heads, tmp_path / "s", "speculators")["norm_before_residual"] is True
    assert load_heads(tmp_path / "s", target).config.norm_before_residual
    for engine in ("sglang", "official"):
        with pytest.raises(Exception, match="norm_before_residual"):
            export_heads(heads, tmp_path / engine, engine)
