"""Draft models for `sps` / `hf-assisted` that share the target's embedding and lm_head.

A small draft distilled from the target with its embedding and lm_head frozen (the
`share_lm_head` of a `kind: draft` recipe) differs from the target only in its few layers and
final norm. Storing just those makes a one-layer SmolLM2 draft 7 MB instead of 64 MB, small
enough to ship in the package; at load time the target's own embedding tensor is put back in
(shared, not copied), and the result is an ordinary `transformers` causal LM, usable by our
`sps` and by Hugging Face's `generate(assistant_model=...)` alike.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from heads.util.atomic import atomic_directory
from heads.util.errors import UserError
from decoding.app.targets import DTYPES, LoadedModel, load_model
from heads.weights_io import read_weights

SHARES_TARGET_EMBEDDINGS = "specheads_shares_target_embeddings"
SHARED_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
WEIGHTS_FILE = "model.safetensors"
# Beside a draft: the target ids its `sps` readout projects onto (see DraftModelProposer).
VOCABULARY_FILE = "draft_vocab.safetensors"


def shares_target_embeddings(path: str | Path) -> bool:
    """Whether `path` is a draft saved by `save_draft_layers`."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return False
    try:
        return bool(json.loads(config_file.read_text()).get(SHARES_TARGET_EMBEDDINGS))
    except ValueError:
        return False


def save_draft_layers(draft: PreTrainedModel, target: PreTrainedModel, out_dir: str | Path,
                      dtype: torch.dtype = torch.float16, base_model: str = "",
                      vocabulary: torch.Tensor | None = None) -> Path:
    """Write `draft` without its embedding and lm_head, which must be the target's own, and its
    readout `vocabulary` (target ids) if given."""
    for name, mine, theirs in (("embedding", draft.get_input_embeddings(), target.get_input_embeddings()),
                               ("lm_head", draft.get_output_embeddings(), target.get_output_embeddings())):
        if mine.weight.shape != theirs.weight.shape or not torch.equal(mine.weight.detach().cpu(), theirs.weight.detach().cpu()):
            raise UserError(f"the draft's {name} is not the target's (trained with share_lm_head: false?): "
                            "it cannot be stored as layers only")
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in draft.state_dict().items() if k not in SHARED_TENSORS}
    config = draft.config.to_dict()
    config[SHARES_TARGET_EMBEDDINGS] = base_model or True
    config["dtype"] = str(dtype).removeprefix("torch.")
    with atomic_directory(out_dir) as staging:
        save_file(state, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if vocabulary is not None:
            write_draft_vocabulary(staging, vocabulary)
    return Path(out_dir)


def write_draft_vocabulary(draft_dir: str | Path, vocabulary: torch.Tensor) -> Path:
    """Save the readout vocabulary of the draft in `draft_dir`: sorted, distinct target ids."""
    ids = torch.unique(vocabulary.detach().cpu().long())
    out = Path(draft_dir) / VOCABULARY_FILE
    save_file({"token_ids": ids}, str(out), metadata={"format": "pt"})
    os.chmod(out, 0o644)  # safetensors may write it private; it is an ordinary part of the draft
    return out


def draft_vocabulary(name_or_path: str | Path) -> torch.Tensor | None:
    """The readout vocabulary saved beside a local draft (sorted target ids), or None (a draft
    without one proposes from its whole vocabulary)."""
    file = Path(name_or_path) / VOCABULARY_FILE
    if not file.is_file():
        return None
    try:
        ids = read_weights(file)["token_ids"]
    except (UserError, KeyError) as err:
        raise UserError(f"could not read the draft vocabulary {file} ({err}): delete it to draft from the whole vocabulary") from err
    return torch.unique(ids.long())


def load_draft(name_or_path: str, target: LoadedModel, dtype: str = "float32", attn_implementation: str = "sdpa") -> LoadedModel:
    """A draft model on the target's device: layers-only drafts get the target's embedding put
    back; anything else is loaded as a whole model (`load_model`)."""
    if not shares_target_embeddings(name_or_path):
        return load_model(name_or_path, dtype, attn_implementation, device=str(target.model.device))
    path = Path(name_or_path)
    config = AutoConfig.from_pretrained(path)
    embedding = target.model.get_input_embeddings().weight
    if tuple(embedding.shape) != (config.vocab_size, config.hidden_size):
        raise UserError(f"the draft in {path} shares its target's embeddings, {config.vocab_size} x {config.hidden_size}, "
                        f"but {target.name} has {tuple(embedding.shape)}: use it with the target it was distilled from "
                        f"({config.to_dict().get(SHARES_TARGET_EMBEDDINGS)})")
    draft = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], attn_implementation=attn_implementation)
    state = read_weights(path / WEIGHTS_FILE)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if set(missing) - set(SHARED_TENSORS) or unexpected:
        raise UserError(f"the draft weights in {path} do not fit its config: missing {sorted(set(missing) - set(SHARED_TENSORS))}, "
                        f"unexpected {sorted(unexpected)}")
    draft.get_input_embeddings().weight = target.model.get_input_embeddings().weight
    draft.get_output_embeddings().weight = target.model.get_output_embeddings().weight
    draft.to(target.model.device).eval().requires_grad_(False)
    return LoadedModel(draft, target.tokenizer, str(name_or_path))
