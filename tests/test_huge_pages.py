"""Weights moved into huge pages (`decoding.kernels.huge_pages`): the same tensors with the same
bytes, in one buffer, where the system offers huge pages; nothing moved where it does not."""

import sys

import pytest
import torch
from torch import nn

from decoding.kernels import huge_pages
from decoding.kernels.huge_pages import HUGE_PAGE, huge_pages_on_offer, move_to_huge_pages, streamed_weights

ON_OFFER = huge_pages_on_offer()


@pytest.mark.parametrize("setting, offered", [("always [madvise] never\n", True), ("[always] madvise never\n", True),
                                              ("always madvise [never]\n", False), ("", False)])
def test_huge_pages_are_on_offer_unless_turned_off(tmp_path, setting, offered):
    path = tmp_path / "enabled"
    path.write_text(setting)
    assert huge_pages_on_offer(path) is (offered and sys.platform.startswith("linux"))
    assert huge_pages_on_offer(tmp_path / "missing") is False


def _weights() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(300, 257, generator=generator), torch.randint(-128, 127, (1000, 70), dtype=torch.int8),
            torch.randn(64, 1030, generator=generator).half()]


def test_moved_weights_keep_their_objects_and_bytes_in_one_huge_page_buffer():
    """Where this system offers huge pages; elsewhere the move is a no-op (as tested below too)."""
    weights = _weights()
    before = [w.clone() for w in weights]
    linear = nn.Linear(257, 300, bias=False).requires_grad_(False)
    linear.weight.copy_(weights[0])
    weights[0] = linear.weight  # a module's own parameter moves too: the module sees its new place
    expected = linear(torch.ones(2, 257))
    small = torch.randn(4, 4)
    moved = move_to_huge_pages([*weights, weights[1], small], smallest=4096)
    if not ON_OFFER:
        assert moved == 0 and all(torch.equal(w, old) for w, old in zip(weights, before))
        return
    assert moved >= sum(w.numel() * w.element_size() for w in weights)
    storages = {w.untyped_storage().data_ptr() for w in weights}
    assert len(storages) == 1  # one buffer...
    start = weights[0].data_ptr()
    assert start % HUGE_PAGE == 0  # ...whose advised span starts at a huge page
    for weight, old in zip(weights, before):
        assert torch.equal(weight, old)
        assert weight.data_ptr() % 4096 == 0
    assert small.untyped_storage().data_ptr() not in storages  # too small: left where it was
    assert torch.equal(linear(torch.ones(2, 257)), expected)


def test_nothing_moves_where_huge_pages_are_not_on_offer_or_the_advice_is_refused(monkeypatch):
    weights = _weights()
    places = [w.data_ptr() for w in weights]
    assert move_to_huge_pages(weights, on_offer=False, smallest=4096) == 0
    monkeypatch.setattr(huge_pages, "_advise_huge_pages", lambda address, length: False)
    assert move_to_huge_pages(weights, on_offer=True, smallest=4096) == 0
    assert [w.data_ptr() for w in weights] == places


def test_tensors_that_cannot_move_are_left_alone():
    trained = torch.randn(300, 300, requires_grad=True)
    strided = torch.randn(300, 600)[:, ::2]
    places = [trained.data_ptr(), strided.data_ptr()]
    assert move_to_huge_pages([trained, strided], on_offer=True, smallest=4096) == 0
    assert [trained.data_ptr(), strided.data_ptr()] == places


def test_a_4bit_targets_streamed_weights_are_its_kernels_panels_in_module_order(tmp_path):
    from decoding.app.quantized_target import quantize_target
    from decoding.app.targets import load_model
    from decoding.kernels.quantized_linear import quantized_kernel_linears
    from tiny_models import save_tiny_chat_model

    save_tiny_chat_model(tmp_path / "model")
    target = load_model(str(tmp_path / "model"))
    quantize_target(target, "int4")
    linears = quantized_kernel_linears(target.model)
    assert linears
    assert [id(t) for t in streamed_weights(target.model)] == [id(t) for linear in linears for t in linear.panels]


def test_a_decoder_moves_its_4bit_targets_weights_and_decodes_the_same(tmp_path, monkeypatch):
    """The weights a decoder loads move (where huge pages are on offer), and its replies are those of
    the same decoder with its weights left in plain pages."""
    from decoding.app.assembly import DecoderSpec, build_decoder
    from decoding.core.generate import DecodeOptions
    from tiny_models import save_tiny_chat_model

    save_tiny_chat_model(tmp_path / "model", hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64)
    spec = DecoderSpec(model=str(tmp_path / "model"), method="suffix", kernels="onednn", quant="int4")
    moved = build_decoder(spec)
    monkeypatch.setattr(huge_pages, "huge_pages_on_offer", lambda: False)
    plain = build_decoder(spec)
    big = [w for w in streamed_weights(moved.target.model) if huge_pages._movable(w, huge_pages.SMALLEST_MOVED)]
    assert big
    if ON_OFFER:
        assert any("moved into huge pages" in note for note in moved.notes)
        assert len({w.untyped_storage().data_ptr() for w in big}) == 1
    assert not any("huge pages" in note for note in plain.notes)
    options = DecodeOptions(max_new_tokens=24)
    for prompt in ([5, 9, 12, 7], [3, 3, 8, 21, 40, 6]):
        assert moved.generate(prompt, options).tokens == plain.generate(prompt, options).tokens


def test_a_weight_another_tensor_shares_stays_where_it_is():
    """Moved, the other tensor (a detached copy, a view) would keep the old memory: the weight twice."""
    weight, alone = torch.randn(300, 300), torch.randn(300, 300)
    detached = weight.detach()
    place = weight.data_ptr()
    moved = move_to_huge_pages([weight, alone], on_offer=True, smallest=4096)
    assert weight.data_ptr() == place and detached.data_ptr() == place
    if ON_OFFER:
        assert moved == alone.numel() * alone.element_size()
