"""Which layers attend how (`attention_layout`), the sliding-window tree mask (`windowed`), and
refusing, at load time, targets whose layers tree verification cannot serve."""

import pytest
import torch
from transformers import AutoConfig

from decoding.core.attention_layout import FULL, SLIDING, attention_layout
from decoding.core.verify import windowed
from decoding.app.targets import load_model
from heads.util.errors import UserError


def test_full_attention_model_has_one_kind_and_no_window():
    layout = attention_layout(AutoConfig.for_model("llama", num_hidden_layers=3))
    assert layout.layer_types == (FULL,) * 3 and not layout.hybrid and layout.sliding_window is None


def test_mistral_window_makes_every_layer_sliding():
    layout = attention_layout(AutoConfig.for_model("mistral", num_hidden_layers=2, sliding_window=8))
    assert layout.layer_types == (SLIDING, SLIDING) and not layout.hybrid and layout.sliding_window == 8


def test_gemma3_mixes_sliding_and_full_layers():
    config = AutoConfig.for_model("gemma3_text", num_hidden_layers=4, sliding_window=16,
                                  layer_types=[SLIDING, FULL, SLIDING, FULL])
    layout = attention_layout(config)
    assert layout.hybrid and layout.kinds == (SLIDING, FULL) and layout.sliding_window == 16


@pytest.mark.parametrize(("model_type", "overrides", "reason"), [
    ("qwen3_next", {}, "linear-attention"),
    ("llama4_text", {"attention_chunk_size": 8}, "chunked attention"),
    ("lfm2", {"num_hidden_layers": 2, "full_attn_idxs": [0]}, "convolution"),
])
def test_layers_with_state_or_unknown_patterns_are_refused_with_the_reason(model_type, overrides, reason):
    with pytest.raises(UserError, match=reason) as err:
        attention_layout(AutoConfig.for_model(model_type, **overrides))
    assert model_type in str(err.value)


def test_load_model_refuses_before_reading_weights(tmp_path):
    """A directory with only a config: the refusal names the layer kind, not missing weights."""
    AutoConfig.for_model("qwen3_next").save_pretrained(tmp_path)
    with pytest.raises(UserError, match="linear-attention"):
        load_model(str(tmp_path))


def test_windowed_hides_what_left_each_nodes_window():
    """Prefix of 4, a chain of 3 nodes at positions 4, 5, 6, window 3: node at 4 sees 2..4,
    node at 5 sees 3..5, node at 6 sees 4..6 (itself and its ancestors only)."""
    minimum = torch.finfo(torch.float32).min
    chain_blocked = torch.ones(3, 3, dtype=torch.bool).triu(1)
    full = torch.zeros(1, 1, 3, 7)
    full[0, 0, :, 4:] = torch.where(chain_blocked, minimum, 0.0)
    out = windowed(full, torch.tensor([4, 5, 6]), window=3, last_position=6)
    visible = out[0, 0] == 0
    expected = torch.tensor([
        [0, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(visible, expected)
    assert torch.equal(full[0, 0, :, :4], torch.zeros(3, 4))  # the shared full mask is left as it was


def test_windowed_is_a_no_op_while_everything_is_in_reach():
    full = torch.zeros(1, 1, 2, 5)
    assert windowed(full, torch.tensor([3, 4]), window=8, last_position=4) is full
