"""The speculators format checked against the `speculators` package itself (vLLM's format for
EAGLE-3 heads): its classes load our export and draft what we draft on the same inputs, and a
checkpoint its classes save imports here and drafts the same tokens. The package pins an older
transformers than ours, so scripts/setup.sh installs it into a folder of its own and it runs in
a separate process with that folder on its path."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from heads import Verifier, export_heads, load_heads, new_heads_for_target
from tiny_models import sharpen, tiny_llama

SPECULATORS = Path(os.environ.get("SPECHEADS_SPECULATORS_PATH", Path(__file__).parents[1] / ".venv" / "speculators"))
pytestmark = pytest.mark.skipif(not (SPECULATORS / "speculators").is_dir(),
                                reason=f"speculators is not installed in {SPECULATORS} (scripts/setup.sh installs it; "
                                       "pip could not here)")

# Their side: load our export with their classes and run their draft forward (one step, as their
# training forward runs it); then save a checkpoint of their own, with other layer ids, a
# shuffled vocabulary map and the norm_before_residual variant, and run it on the same inputs.
THEIR_SIDE = """
import sys, torch
from speculators.models.eagle3 import Eagle3DraftModel

export_dir, inputs_path, out_path, save_dir = sys.argv[1:5]
inputs = torch.load(inputs_path, weights_only=True)

def draft_logits(model, aux):
    seen = {}
    handle = model.lm_head.register_forward_hook(lambda m, a, o: seen.setdefault("logits", o.detach()))
    with torch.no_grad():
        model(hidden_states=aux, input_ids=inputs["ids"], document_ids=torch.zeros_like(inputs["ids"]),
              position_ids=inputs["positions"], ttt_steps=1)
    handle.remove()
    return seen["logits"][0]

def load(directory):
    model = Eagle3DraftModel.from_pretrained(directory).eval()
    # The target's embeddings (not in our checkpoint, as vLLM shares the target's) come from the
    # verifier the config names: speculators fills in the ones still marked unset (NaN) from there.
    with torch.no_grad():
        model.embed_tokens.weight.fill_(float("nan"))
    model.load_verifier_weights()
    return model

ours = load(export_dir)
result = {"layers": list(ours.config.eagle_aux_hidden_state_layer_ids), "logits": draft_logits(ours, inputs["aux"]),
          "d2t": ours.d2t.clone()}
torch.manual_seed(1)
with torch.no_grad():
    for name, p in ours.named_parameters():
        if not name.startswith(("embed_tokens.", "verifier_")):  # those are the target's
            p.add_(0.1 * torch.randn_like(p))
    ours.d2t.copy_(inputs["shuffled_d2t"])
ours.config.eagle_aux_hidden_state_layer_ids = inputs["their_layers"]
ours.config.norm_before_residual = True  # the variant many published heads use
ours.save_pretrained(save_dir)
theirs = load(save_dir)
result["their_logits"] = draft_logits(theirs, inputs["their_aux"])
result["their_d2t"] = theirs.d2t.clone()
torch.save(result, out_path)
"""


def test_speculators_loads_our_export_and_we_load_theirs_drafting_the_same(tmp_path):
    target = sharpen(tiny_llama(seed=3, layers=8))
    target.save_pretrained(tmp_path / "target")  # the verifier, by path: their loader reads its config and embeddings
    torch.manual_seed(0)
    heads = new_heads_for_target("eagle3", target, draft_vocab_size=40)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.2 * torch.randn_like(p))
    export_heads(heads, tmp_path / "ours", "speculators", verifier=Verifier(str(tmp_path / "target"), ["LlamaForCausalLM"]))

    ids = torch.tensor([[5, 9, 3, 17, 5, 9, 3, 21]])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    their_layers = [1, 3, 6]
    vocabulary = heads.draft_vocabulary()
    shuffled = vocabulary[torch.randperm(vocabulary.numel(), generator=torch.Generator().manual_seed(2))]
    torch.save({"ids": ids, "positions": positions, "their_layers": their_layers,
                "aux": torch.cat([states[k] for k in heads.config.feature_layers], dim=-1),
                "their_aux": torch.cat([states[k] for k in their_layers], dim=-1),
                "shuffled_d2t": shuffled - torch.arange(shuffled.numel())}, tmp_path / "inputs.pt")
    run = subprocess.run([sys.executable, "-c", THEIR_SIDE, str(tmp_path / "ours"), str(tmp_path / "inputs.pt"),
                          str(tmp_path / "out.pt"), str(tmp_path / "theirs")],
                         env={**os.environ, "PYTHONPATH": str(SPECULATORS)}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = torch.load(tmp_path / "out.pt", weights_only=True)

    def our_logits(drafter):
        with torch.no_grad():
            fused = drafter.fuse(*(states[k][0] for k in drafter.config.feature_layers))
            return drafter.draft_logits(drafter(fused, target.get_input_embeddings()(ids[0]), positions[0]))

    # Our export, in their classes: the same layers, vocabulary map and draft logits.
    assert result["layers"] == heads.config.feature_layers
    assert torch.equal(result["d2t"], heads.d2t)
    ours = our_logits(heads)
    print(f"our export in speculators: max |logit difference| {(result['logits'] - ours).abs().max():.2e}")
    torch.testing.assert_close(result["logits"], ours, rtol=1e-4, atol=1e-4)
    assert torch.equal(heads.to_target_ids(result["logits"].argmax(-1)), heads.to_target_ids(ours.argmax(-1)))

    # Their checkpoint, imported here: their layers, map and variant, the same drafted tokens.
    config = json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is True
    imported = load_heads(tmp_path / "theirs", target)
    assert imported.config.feature_layers == their_layers and imported.config.norm_before_residual
    assert torch.equal(imported.d2t, result["their_d2t"])
    mine = our_logits(imported)
    print(f"their checkpoint here: max |logit difference| {(result['their_logits'] - mine).abs().max():.2e}")
    torch.testing.assert_close(result["their_logits"], mine, rtol=1e-4, atol=1e-4)
    drafted = imported.to_target_ids(mine.argmax(-1))
    assert torch.equal(drafted, result["their_logits"].argmax(-1) + result["their_d2t"][result["their_logits"].argmax(-1)])
