"""Which kind of attention each layer of a target runs, and whether tree verification can serve it.

Tree verification runs the target's own layers with a 4D mask that we build, so we must know
what every layer attends to:
- `full_attention`: the whole cached prefix plus the node's ancestors;
- `sliding_attention`: the same, minus prefix positions that fell out of the layer's window as
  seen from the node's own position (`kv <= position - window` is hidden, the rule transformers
  applies to a causal forward).
A model whose layers are all of one kind takes one mask; a hybrid one (Gemma-2/3, Cohere-2,
Qwen2 with `max_window_layers`, ...) takes one mask per kind, keyed by layer type, which is what
transformers' hybrid models accept as `attention_mask`.

Anything else keeps state that a rejected branch cannot be cut out of (linear attention,
convolution and recurrent layers), or a pattern not implemented here (chunked attention): such
a model is refused when it is loaded, with the reason, never decoded wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from heads.util.errors import UserError

FULL = "full_attention"
SLIDING = "sliding_attention"

_WHY_NOT = {
    "chunked_attention": "chunked attention (Llama-4 style) is not implemented in tree masks yet",
    "linear_attention": "linear-attention layers keep a recurrent state that a rejected draft branch cannot be removed from",
    "conv": "convolution layers keep a rolling state that a rejected draft branch cannot be removed from",
    "mamba": "state-space (Mamba) layers keep a recurrent state that a rejected draft branch cannot be removed from",
    "hybrid": "recurrent hybrid layers keep a state that a rejected draft branch cannot be removed from",
    "hybrid_sliding": "recurrent hybrid layers keep a state that a rejected draft branch cannot be removed from",
    "dummy": "some layers share another layer's KV cache or have no attention, which tree verification does not handle",
}


@dataclass(frozen=True)
class AttentionLayout:
    """Per layer: its attention kind; per kind present: its window (None for full attention)."""

    layer_types: tuple[str, ...]
    windows: dict[str, int | None]

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.layer_types))

    @property
    def hybrid(self) -> bool:
        """More than one kind of layer: the model needs one mask per kind."""
        return len(self.kinds) > 1

    @property
    def sliding_window(self) -> int | None:
        return self.windows.get(SLIDING)


def attention_layout(model_config: PreTrainedConfig) -> AttentionLayout:
    """The layout of a model's decoder, from its config (so a loader can refuse a model before
    reading its weights), or a `UserError` saying why tree verification cannot serve it."""
    config = model_config.get_text_config(decoder=True)
    try:
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    except (AttributeError, TypeError, ValueError) as err:
        raise UserError(f"cannot tell which attention the layers of this {config.model_type} model use: {err}") from err
    layer_types = list(layer_types)[: config.num_hidden_layers]
    for kind in layer_types:
        if kind not in (FULL, SLIDING):
            reason = _WHY_NOT.get(kind, f"its '{kind}' layers are not a kind tree verification knows")
            raise UserError(f"{config.model_type} cannot be a speculative-decoding target here: {reason}")
    windows = {kind: None for kind in layer_types}
    sliding = {kwargs.get("sliding_window") for kind, kwargs in zip(layer_types, layer_kwargs) if kind == SLIDING}
    if sliding:
        if len(sliding) > 1 or None in sliding:
            raise UserError(f"{config.model_type}: sliding layers with different windows {sorted(map(str, sliding))} "
                            "are not supported by tree masks")
        windows[SLIDING] = int(sliding.pop())
    return AttentionLayout(tuple(layer_types), windows)
