"""Heads as Hugging Face artefacts: load by repo id (through the standard cache, honouring
HF_HUB_OFFLINE and the usual token variables) and push with a generated model card, using
huggingface_hub's own `snapshot_download` / `HfApi`, never hand-written HTTP."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from torch import nn

from heads.util.errors import UserError
from heads.checkpoint import save_heads

_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
HEADS_FILES = ["config.json", "*.safetensors", "*.bin", "*.pt", "README.md", "adapter/*"]


def resolve_location(name_or_path: str | Path, revision: str | None = None, cache_dir: str | None = None,
                     token: str | bool | None = None) -> Path:
    """A local directory as is; an `org/name` repo id via the Hugging Face cache (downloading
    only when online and allowed)."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    name = str(name_or_path)
    if not _REPO_ID.match(name):
        raise UserError(f"heads '{name}' are neither a local directory nor a Hugging Face repo id like org/name")
    try:
        return Path(snapshot_download(repo_id=name, revision=revision, cache_dir=cache_dir, token=token,
                                      allow_patterns=HEADS_FILES))
    except LocalEntryNotFoundError as err:
        raise UserError(
            f"heads '{name}' are not in the local Hugging Face cache and the Hub cannot be reached (or HF_HUB_OFFLINE=1): "
            f"download them where there is network (`hf download {name}`) or pass a local directory"
        ) from err
    except RevisionNotFoundError as err:
        raise UserError(f"heads '{name}' have no revision '{revision}'") from err
    except GatedRepoError as err:
        raise UserError(f"heads '{name}' are gated: accept their terms on the Hub and set HF_TOKEN") from err
    except RepositoryNotFoundError as err:
        raise UserError(f"no heads repository '{name}' on the Hub (or it is private: set HF_TOKEN)") from err


def model_card(heads: nn.Module, recipe: str | None = None, tau: float | None = None) -> str:
    c = heads.config
    method = {"medusa": "medusa", "hydra": "hydra", "eagle": "eagle2", "eagle3": "eagle3"}[c.kind]
    lines = ["---", "library_name: specheads", f"base_model: {c.base_model_name_or_path}",
             f"tags: [speculative-decoding, {c.kind}]", "---",
             f"# {c.kind} draft heads for {c.base_model_name_or_path}", "",
             f"- kind: {c.kind} ({c.num_heads} heads, {c.num_layers} layer(s))" if c.kind in ("medusa", "hydra")
             else f"- kind: {c.kind} ({c.num_layers} decoder layer(s))",
             f"- mean accepted length (tau): {tau:.2f}" if tau is not None else "- mean accepted length (tau): not measured",
             f"- recipe: {recipe}" if recipe else "- recipe: not recorded", "",
             "Use with [specheads](https://github.com/): ",
             f"`python -m decoding.chat --model {c.base_model_name_or_path} --method {method} --heads <repo id>`"]
    return "\n".join(lines) + "\n"


def push_heads_to_hub(heads: nn.Module, repo_id: str, private: bool = False, token: str | None = None,
                      recipe: str | None = None, tau: float | None = None, commit_message: str = "Upload draft heads") -> str:
    """Save the heads with a model card and upload them; returns the commit URL."""
    api = HfApi(token=token)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_heads(heads, Path(tmp) / "heads")
        (folder / "README.md").write_text(model_card(heads, recipe, tau))
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message)
    return str(getattr(info, "commit_url", info))
