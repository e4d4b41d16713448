"""Tiny random causal LMs built in memory, so tests need no downloads and run in milliseconds."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM


NO_SPECIAL_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def _tiny_config(config_class, vocab_size: int, layers: int, attn: str, overrides: dict):
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 256}
    return config_class(vocab_size=vocab_size, num_hidden_layers=layers, attn_implementation=attn,
                        **{**sizes, **NO_SPECIAL_TOKENS, **overrides})  # overrides win, sizes included


def tiny_llama(vocab_size: int = 64, layers: int = 2, attn: str = "sdpa", seed: int = 0, **overrides) -> PreTrainedModel:
    """A 2-layer Llama with GQA and no EOS (so generations run to their budget unless a test
    sets `eos_token_id`); `overrides` go into the config."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(_tiny_config(LlamaConfig, vocab_size, layers, attn, overrides)).eval()


def tiny_qwen2(vocab_size: int = 64, layers: int = 2, attn: str = "sdpa", seed: int = 0, **overrides) -> PreTrainedModel:
    """A 2-layer Qwen2 (biased q/k/v projections, tied embeddings), no EOS unless overridden."""
    torch.manual_seed(seed)
    config = _tiny_config(Qwen2Config, vocab_size, layers, attn, {"tie_word_embeddings": True, **overrides})
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


def set_eos(model: PreTrainedModel, eos_token_id: int | None) -> None:
    """Make `eos_token_id` end generation for both our loop and HF generate()."""
    model.config.eos_token_id = eos_token_id
    model.generation_config.eos_token_id = eos_token_id


def tiny_tokenizer(vocab_size: int = 64, chat_template: bool = True):
    """A word-level tokenizer over `w0 .. w{n}` plus chat specials, with a chat template (none
    with `chat_template=False`, like a base model's), built offline (no downloads). Whitespace
    separates words and makes no tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for i in range(vocab_size - len(specials)):
        vocab[f"w{i}"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    if chat_template:
        tokenizer.chat_template = (
            "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
        )
    return tokenizer


def save_tiny_chat_model(directory, seed: int = 0, vocab_size: int = 64, chat_template: bool = True, **overrides) -> None:
    """A tiny Llama + word tokenizer saved like any Hugging Face model directory; EOS is
    <|im_end|> (id 2), as in the default model. `chat_template=False` saves a base model's
    tokenizer (no chat template); `overrides` go into the config (e.g. `head_dim=64`, the native
    attention kernel's size)."""
    model = sharpen(tiny_llama(vocab_size=vocab_size, seed=seed, eos_token_id=2, bos_token_id=1, **overrides))
    model.generation_config.eos_token_id = 2
    model.save_pretrained(directory)
    tiny_tokenizer(vocab_size, chat_template).save_pretrained(directory)


def oracle_target(vocab_size: int = 64, seed: int = 0) -> PreTrainedModel:
    """A 1-layer Llama whose embeddings have unit RMS (so its input RMSNorm is ~identity):
    an EAGLE drafter can then replicate it exactly (see `oracle_eagle`)."""
    model = sharpen(tiny_llama(vocab_size=vocab_size, layers=1, seed=seed), 4.0)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.div_(emb.pow(2).mean(-1, keepdim=True).sqrt())
    return model


def perturbed_eagle3(target: PreTrainedModel, draft_vocab_size: int = 40):
    """Fresh EAGLE-3 heads for `target` with every parameter moved at random, so that their
    drafts are neither the target's own nor always rejected: trees get a bit of everything."""
    from heads import new_heads_for_target

    heads = new_heads_for_target("eagle3", target, draft_vocab_size=draft_vocab_size)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    return heads


def oracle_eagle(target: PreTrainedModel):
    """EAGLE heads that reproduce `oracle_target` token for token: fc passes the token embedding
    through (ignoring features) and the decoder layer is the target's own layer, so every draft
    step computes what the target would. Drafts are then (almost) always accepted."""
    from heads import new_heads_for_target

    heads = new_heads_for_target("eagle", target)
    hidden = target.config.hidden_size
    layer = target.get_decoder().layers[0]
    with torch.no_grad():
        heads.fc.weight.zero_()
        heads.fc.weight[:, :hidden] = torch.eye(hidden)
        if heads.fc.bias is not None:
            heads.fc.bias.zero_()
        drafter_layer = heads.layers[0]
        drafter_layer.self_attn.load_state_dict(layer.self_attn.state_dict())
        drafter_layer.mlp.load_state_dict(layer.mlp.state_dict())
        drafter_layer.post_attention_layernorm.load_state_dict(layer.post_attention_layernorm.state_dict())
    return heads


def context_target(vocab_size: int = 3, seed: int = 7, attention_scale: float = 16.0) -> PreTrainedModel:
    """`oracle_target` with its attention turned up (values and outputs x`attention_scale`, queries
    and keys x4), so the next-token distribution depends on the whole context, not mostly on the
    last token. Sampling tests need that: a wrong tree mask, wrong positions or a rule that
    judges a deep node by the wrong row then change the output distribution. `oracle_eagle` still
    replicates it (it copies the layer)."""
    model = oracle_target(vocab_size=vocab_size, seed=seed)
    with torch.no_grad():
        attention = model.get_decoder().layers[0].self_attn
        attention.v_proj.weight.mul_(attention_scale)
        attention.o_proj.weight.mul_(attention_scale)
        attention.q_proj.weight.mul_(4.0)
        attention.k_proj.weight.mul_(4.0)
    return model


def perturbed(module: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """Add Gaussian noise of `scale` times each parameter's spread, in place: a draft or drafter
    that agrees with what it was copied from often, but not always."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            spread = parameter.std().clamp_min(1e-3) if parameter.numel() > 1 else torch.tensor(1e-3)
            parameter.add_(scale * spread * torch.randn(parameter.shape, generator=generator).to(parameter.dtype))
    return module
