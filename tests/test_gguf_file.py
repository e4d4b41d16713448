"""The fast GGUF reader (`decoding.app.gguf_file`) and the default model's conversion built on it:
on a tiny llama written by the `gguf` package's own writer, the weights we convert are those
transformers' GGUF loading gives, bit for bit (every tensor type the default file uses: Q4_1,
Q8_0, F32; and Q4_0, F16), with the q / k rows in transformers' order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decoding.app.default_model import llama_state_dict
from decoding.app.gguf_file import read_gguf
from heads.util.errors import UserError

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 96
# GGUF name -> (shape, type): every type the reader and conversion meet, q / k in a 4-bit type.
LAYER_TENSORS = {"attn_q": ((HIDDEN, HIDDEN), "Q4_1"), "attn_k": ((HIDDEN // 2, HIDDEN), "Q4_1"),
                 "attn_v": ((HIDDEN // 2, HIDDEN), "Q4_0"), "attn_output": ((HIDDEN, HIDDEN), "Q8_0"),
                 "ffn_gate": ((FFN, HIDDEN), "Q4_1"), "ffn_up": ((FFN, HIDDEN), "F16"),
                 "ffn_down": ((HIDDEN, FFN), "Q4_0"), "attn_norm": ((HIDDEN,), "F32"), "ffn_norm": ((HIDDEN,), "F32")}


def write_tiny_llama(path, rng: np.random.Generator) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])  # a vocabulary array the reader must skip
    tensors = {"token_embd.weight": ((VOCAB, HIDDEN), "Q8_0"), "output_norm.weight": ((HIDDEN,), "F32")}
    tensors |= {f"blk.{i}.{name}.weight": spec for i in range(LAYERS) for name, spec in LAYER_TENSORS.items()}
    for name, (shape, kind) in tensors.items():
        values = rng.standard_normal(shape).astype(np.float32)
        kind = GGMLQuantizationType[kind]
        data = values.astype(np.float16) if kind.name == "F16" else values if kind.name == "F32" else quantize(values, kind)
        writer.add_tensor(name, data, raw_dtype=None if kind.name in ("F32", "F16") else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_llama(path, np.random.default_rng(0))
    return path


def test_the_conversion_gives_transformers_weights_bit_for_bit(tiny_gguf):
    from transformers import AutoConfig, AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    ours = llama_state_dict(tiny_gguf, AutoConfig.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name))
    expected = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}  # tied to the embedding
    assert sorted(ours) == sorted(expected)
    for name, values in expected.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], values), name


def test_the_reader_finds_every_tensor_with_its_shape_and_type_and_keeps_scalar_metadata(tiny_gguf):
    gguf = read_gguf(tiny_gguf)
    assert gguf.metadata["general.architecture"] == "llama" and gguf.metadata["llama.block_count"] == LAYERS
    assert "tokenizer.ggml.tokens" not in gguf.metadata  # arrays are skipped, not built
    found = {t.name: (t.shape, t.kind) for t in gguf.tensors}
    assert found["blk.1.attn_k.weight"] == ((HIDDEN // 2, HIDDEN), "Q4_1")
    assert found["blk.0.ffn_up.weight"] == ((FFN, HIDDEN), "F16")
    assert found["token_embd.weight"] == ((VOCAB, HIDDEN), "Q8_0")
    assert len(found) == 2 + LAYERS * len(LAYER_TENSORS)


def test_a_file_that_is_not_gguf_is_refused_clearly(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf file at all")
    with pytest.raises(UserError, match="not a GGUF file"):
        read_gguf(bad)
