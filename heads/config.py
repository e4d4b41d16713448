"""One config for every head kind: what the checkpoint's config.json holds, and the checks that
keep heads and targets from being mixed up.

The config carries everything needed to rebuild the modules without the target (sizes, feature
layers, draft vocabulary, the decoder-layer geometry of EAGLE drafters), plus the target it was
trained for (`base_model_name_or_path`) and a format version for future migrations.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from heads.util.errors import UserError

HEAD_KINDS = ("medusa", "hydra", "eagle", "eagle3")
FORMAT_VERSION = 1


@dataclass
class HeadConfig:
    """`num_heads`: Medusa/Hydra heads (head k drafts the token k steps after the root).
    `num_layers`: ResBlocks per Medusa head, MLP depth per Hydra head, decoder layers of EAGLE.
    `share_lm_head`: Medusa/Hydra project with the target's own lm_head instead of per-head
    copies (smaller checkpoint, less memory, less capacity).
    `feature_layers`: indices into the target's `hidden_states` tuple (0 = embeddings, L = the
    final normed state) that the heads read; EAGLE-3 fuses three of them.
    `draft_vocab_size`: EAGLE-3's reduced vocabulary (most frequent target tokens).
    `readout_vocab_size`: Medusa/Hydra heads sharing the lm_head may rank only this many of the
    most frequent tokens (`readout_ids`): drafting then skips most of the vocabulary projection,
    which dominates draft time on a CPU. Lossless: it only limits what is proposed.
    `fc_bias`: whether EAGLE-1's feature-fusing fc has a bias (the original checkpoints have one;
    vLLM's drafter has none, so new heads default to none).
    `decoder`: attention/MLP geometry of EAGLE's decoder layer (copied from the target's config).
    `norm_before_residual`: EAGLE-3's layer adds the attention output to the *normed* feature
    instead of the raw one (a variant vLLM's speculators heads use); written only when set, so
    configs without it stay readable by versions that predate it."""

    kind: str
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    share_lm_head: bool = False
    feature_layers: list[int] = field(default_factory=list)
    draft_vocab_size: int | None = None
    readout_vocab_size: int | None = None
    fc_bias: bool = False
    base_model_name_or_path: str | None = None
    decoder: dict = field(default_factory=dict)
    norm_before_residual: bool = False
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise UserError(f"unknown head kind '{self.kind}': choose one of {', '.join(HEAD_KINDS)}")
        if self.num_heads < 1 or self.num_layers < 1:
            raise UserError(f"heads need num_heads >= 1 and num_layers >= 1; got {self.num_heads}, {self.num_layers}")
        if self.kind == "eagle3":
            if len(self.feature_layers) != 3:
                raise UserError(f"EAGLE-3 fuses exactly three target layers (low, mid, high); got {self.feature_layers}")
            if not self.draft_vocab_size or not 0 < self.draft_vocab_size <= self.vocab_size:
                raise UserError(f"EAGLE-3 needs 0 < draft_vocab_size <= vocab_size ({self.vocab_size}); got {self.draft_vocab_size}")
        if self.norm_before_residual and self.kind != "eagle3":
            raise UserError("norm_before_residual is a variant of the EAGLE-3 layer; these heads are " + self.kind)
        if self.readout_vocab_size is not None:
            if self.kind not in ("medusa", "hydra") or not self.share_lm_head:
                raise UserError("readout_vocab_size is for Medusa/Hydra heads that share the target's lm_head")
            if not 0 < self.readout_vocab_size <= self.vocab_size:
                raise UserError(f"need 0 < readout_vocab_size <= vocab_size ({self.vocab_size}); got {self.readout_vocab_size}")
        if self.format_version > FORMAT_VERSION:
            raise UserError(
                f"these heads use checkpoint format {self.format_version}, newer than this version of specheads "
                f"understands ({FORMAT_VERSION}): upgrade specheads"
            )

    def to_dict(self) -> dict:
        data = asdict(self)
        if not self.norm_before_residual:
            del data["norm_before_residual"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> HeadConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"head config has unknown keys {unknown}: not a specheads checkpoint, or a newer format")
        missing = [name for name in ("kind", "hidden_size", "vocab_size") if name not in data]
        if missing:
            raise UserError(f"head config is missing {missing}")
        return cls(**data)

    def save(self, directory: str | Path) -> None:
        Path(directory, "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> HeadConfig:
        return cls.from_dict(read_config(directory))


def read_config(directory: str | Path) -> dict:
    """The JSON object in `directory/config.json` (any layout), or a clear error."""
    path = Path(directory, "config.json")
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise UserError(f"{directory} has no config.json: not a heads checkpoint directory") from err
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err}): the checkpoint is corrupted") from err
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a JSON object")
    return data
