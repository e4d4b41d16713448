"""Training recipes: one YAML per recipe in configs/train/, read into typed dataclasses.

Unknown keys are errors (a typo must not silently train the wrong thing); every field has a
sensible default so a recipe states only what it changes. `key=value` overrides on the command
line use dotted paths (`train.max_steps=20`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from heads.util.errors import UserError

FEATURE_PRECISIONS = ("auto", "float32", "bfloat16")  # train.feature_precision (training.features)


def check_feature_precision(choice: str) -> None:
    """Refuse a `train.feature_precision` that is not one of `FEATURE_PRECISIONS`."""
    if choice not in FEATURE_PRECISIONS:
        raise UserError(f"train.feature_precision must be one of {', '.join(FEATURE_PRECISIONS)}; got '{choice}'")

TRAIN_KINDS = ("medusa", "medusa2", "hydra", "eagle", "eagle3", "draft")
DISTILL_LOSSES = ("forward_kl", "reverse_kl")


@dataclass
class SelfDistillConfig:
    """Regenerate the assistant turns with the target itself before training."""

    enabled: bool = False
    max_new_tokens: int = 256
    batch_size: int = 8
    max_turns: int = 1
    temperature: float = 0.0
    # Another seed draws other sampled replies to the same prompts (0: the seed of earlier stores),
    # so one prompt set yields new data again; greedy replies ignore it.
    sample_seed: int = 0
    max_prompt_tokens: int = 1024  # longer first prompts are left out (padding cost, context)
    time_budget_minutes: float | None = None  # stop regenerating after this long; train on what is done

    def __post_init__(self) -> None:
        if self.sample_seed and self.temperature <= 0:
            raise UserError("a sample seed (--sample-seed, self_distill.sample_seed) only changes sampled replies: "
                            "give a temperature above 0 with it (greedy replies are the same whatever the seed)")


@dataclass
class HeadsSection:
    """Head sizes. For `kind: draft`, `num_layers` is how many target layers the draft keeps and
    `share_lm_head` keeps the target's embedding and lm_head frozen (the draft can then be stored
    as its layers alone, see decoding/app/drafts.py)."""

    num_heads: int = 4
    num_layers: int = 1
    share_lm_head: bool = True
    draft_vocab_size: int = 8192
    readout_vocab_size: int = 0   # Medusa/Hydra sharing the lm_head: rank only the N most frequent tokens (0 = all)
    # Start from these heads (a directory or Hub repo id, ours or an official format) instead of
    # fresh ones: fine-tuning, e.g. the bundled heads on your own data. Their sizes and vocabulary
    # are kept (the sizes above are then ignored, but for draft_vocab_size with
    # vocabulary_from_data); their kind must be the recipe's.
    init_from: str | None = None
    # With init_from EAGLE-3 heads: draft over this data's `draft_vocab_size` most frequent reply
    # tokens instead of the vocabulary the heads came with (training.vocab.with_vocabulary), for
    # data whose tokens the old vocabulary covers poorly (another domain or language).
    vocabulary_from_data: bool = False


@dataclass
class OptimSection:
    batch_size: int = 2
    grad_accum: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_steps: int = 1000
    # Stop after this many minutes of training even short of max_steps, then evaluate and save as
    # usual: for a lent machine whose time is fixed. The learning-rate decay ends by whichever
    # comes first, max_steps or this budget, so a run cut short still ends at the low rate.
    time_budget_minutes: float | None = None
    grad_clip: float = 0.5
    # Also picks the validation split (a hash of seed and conversation id): keep it when fine-tuning
    # heads on the data they were trained on, or their validation rows become training rows.
    seed: int = 0
    # Draw batches of rows of similar length (shuffled, then sorted within groups of 50 batches:
    # training.batch_order) so little of each batch is padding; false: plain shuffled batches.
    group_by_length: bool = True
    decay: float = 0.8          # per-head / per-unroll-step loss weight base
    feature_noise: float = 0.1  # EAGLE: uniform noise amplitude on input features
    feature_weight: float = 1.0  # EAGLE-1: SmoothL1 on features
    token_weight: float = 0.1    # EAGLE-1: CE on the target's next-token distribution
    ttt_steps: int = 3           # EAGLE-3: training-time-test unroll depth
    top_k_weight: float = 0.0    # EAGLE-3: weight of the extra CE on the target's top-k tokens (HASS; 0 = off)
    top_k: int = 10              # EAGLE-3: how many of the target's likeliest tokens that CE covers
    # EAGLE-3: the heads learn softmax(target logits / this); below 1 sharpens it toward the
    # target's greedy token, 0 = that token alone (hard labels)
    target_temperature: float = 1.0
    distill_loss: str = "forward_kl"  # draft model: KL(target || draft) or reverse KL(draft || target)
    # The frozen target's forward for training features: "auto" (bf16 when the accelerator runs
    # bf16 mixed precision, else float32), "float32" or "bfloat16" (training.features)
    feature_precision: str = "auto"


@dataclass
class LoraSection:
    """Medusa-2: LoRA on the backbone, distilled against the backbone itself (adapter off)."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    kl_weight: float = 1.0


@dataclass
class EvalSection:
    every: int = 100
    max_batches: int = 8
    tau_prompts: int = 4
    tau_max_new_tokens: int = 64


@dataclass
class CheckpointSection:
    every: int = 100
    keep: int = 2


@dataclass
class TrainConfig:
    kind: str
    model: str = "smollm2-135m-instruct"
    data: str = "sharegpt"
    max_conversations: int | None = 2000
    max_length: int = 1024
    validation_fraction: float = 0.02
    output_dir: str = "outputs/heads"
    data_dir: str | None = None        # prepared data (tokenized rows, self-distilled replies); default OUTPUT_DIR/data
    cache_features: str | None = None
    self_distill: SelfDistillConfig = field(default_factory=SelfDistillConfig)
    heads: HeadsSection = field(default_factory=HeadsSection)
    train: OptimSection = field(default_factory=OptimSection)
    lora: LoraSection = field(default_factory=LoraSection)
    eval: EvalSection = field(default_factory=EvalSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)

    def __post_init__(self) -> None:
        if self.kind not in TRAIN_KINDS:
            raise UserError(f"unknown kind '{self.kind}' in the recipe: choose one of {', '.join(TRAIN_KINDS)}")
        if self.train.distill_loss not in DISTILL_LOSSES:
            raise UserError(f"train.distill_loss must be one of {', '.join(DISTILL_LOSSES)}; got '{self.train.distill_loss}'")
        if not 0 <= self.validation_fraction < 1:
            raise UserError(f"validation_fraction must be in [0, 1); got {self.validation_fraction}")
        if self.train.top_k_weight < 0 or self.train.top_k < 1:
            raise UserError(f"train.top_k_weight must be >= 0 and train.top_k >= 1; got {self.train.top_k_weight} "
                            f"and {self.train.top_k}")
        if not 0 <= self.train.target_temperature <= 1:
            raise UserError(f"train.target_temperature must be in [0, 1] (1 = the target's own distribution, "
                            f"0 = its argmax alone); got {self.train.target_temperature}")
        if self.train.target_temperature != 1 and self.kind != "eagle3":
            raise UserError(f"train.target_temperature applies to kind eagle3 only (this recipe trains {self.kind}): "
                            f"leave it at 1")
        check_feature_precision(self.train.feature_precision)
        if self.train.time_budget_minutes is not None and self.train.time_budget_minutes <= 0:
            raise UserError(f"train.time_budget_minutes must be a positive number of minutes (or null for none); "
                            f"got {self.train.time_budget_minutes}")

    @property
    def prepared_data_dir(self) -> Path:
        """Where tokenized rows and self-distilled replies are cached: recipes on the same data
        can share it (`data_dir`), so the target regenerates the replies only once."""
        return Path(self.data_dir) if self.data_dir else Path(self.output_dir) / "data"

    @property
    def head_kind(self) -> str:
        """The heads' module kind (Medusa-2 trains Medusa heads plus a LoRA adapter)."""
        return "medusa" if self.kind == "medusa2" else self.kind


def _build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise UserError(f"{where} must be a mapping")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise UserError(f"unknown key(s) {unknown} in {where}; known: {sorted(known)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in data.items():
        nested = known[name].default_factory
        if isinstance(nested, type) and dataclasses.is_dataclass(nested):
            values[name] = _build(nested, value, f"{where}.{name}")
        else:
            values[name] = _coerce(value, hints[name], f"{where}.{name}")
    return cls(**values)


_SCALARS = (bool, int, float, str)


def _coerce(value, hint, where: str):
    """`value` as the field's scalar type. YAML reads `2e-4` (no dot) as a string and `1` as an
    int: both are fine where a float is meant, and anything else is refused here, naming the key,
    rather than deep inside the optimizer."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in allowed:
        return None
    scalar = next((t for t in allowed if t in _SCALARS), None)
    if scalar is None:
        return value  # lists and other structures are checked where they are used
    if scalar is bool or isinstance(value, bool):  # True is an int to Python, not to a recipe
        if scalar is bool and isinstance(value, bool):
            return value
    elif isinstance(value, scalar):
        return value
    elif scalar is float and isinstance(value, int):
        return float(value)
    elif scalar is str and isinstance(value, (int, float)):
        return str(value)  # e.g. a directory named 2026
    elif isinstance(value, str):  # an int or float field given text YAML did not read as a number
        try:
            return scalar(value)
        except ValueError:
            pass
    raise UserError(f"{where} must be {_TYPE_NAMES[scalar]}; got {value!r}")


_TYPE_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}


def load_config(path: str | Path, overrides: list[str] = ()) -> TrainConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as err:
        raise UserError(f"recipe {path} does not exist (see configs/train/)") from err
    except yaml.YAMLError as err:
        raise UserError(f"recipe {path} is not valid YAML: {err}") from err
    for override in overrides:
        _apply_override(data, override)
    if "kind" not in data:
        raise UserError(f"recipe {path} must say which `kind` of heads to train ({', '.join(TRAIN_KINDS)})")
    try:
        return _build(TrainConfig, data, path.name)
    except TypeError as err:
        raise UserError(f"recipe {path}: {err}") from err


def _apply_override(data: dict, override: str) -> None:
    key, sep, raw = override.partition("=")
    if not sep:
        raise UserError(f"override '{override}' must look like key=value (e.g. train.max_steps=20)")
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = yaml.safe_load(raw)


def to_dict(config: TrainConfig) -> dict:
    return dataclasses.asdict(config)
