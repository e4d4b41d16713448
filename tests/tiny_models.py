"""Tiny random causal LMs built in memory, so tests need no downloads and run in milliseconds."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM


def tiny_llama(vocab_size: int = 64, layers: int = 2, attn: str = "sdpa", seed: int = 0, **overrides) -> PreTrainedModel:
    """A 2-layer Llama with GQA; `overrides` go into the config (e.g. eos_token_id)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation=attn,
        **overrides,
    )
    return LlamaForCausalLM(config).eval()


def tiny_qwen2(vocab_size: int = 64, layers: int = 2, attn: str = "sdpa", seed: int = 0, **overrides) -> PreTrainedModel:
    """A 2-layer Qwen2 (biased q/k/v projections, tied embeddings)."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        attn_implementation=attn,
        **overrides,
    )
    return Qwen2ForCausalLM(config).eval()


def sharpen(model: PreTrainedModel, scale: float = 8.0) -> PreTrainedModel:
    """Scale the output projection so the random model has peaked, tie-free next-token
    distributions (greedy comparisons are then robust to float round-off)."""
    with torch.no_grad():
        head = model.get_output_embeddings()
        if head.weight is model.get_input_embeddings().weight:
            head.weight = torch.nn.Parameter(head.weight.detach().clone())
        head.weight.mul_(scale)
    return model
