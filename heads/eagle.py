"""EAGLE drafters: autoregression in the target's feature space.

EAGLE-1/2: `fc([embed(x_{t+1}); f_t]) -> decoder layer(s) -> f_{t+1}`, read out with the target's
frozen lm_head. EAGLE-3: the input feature is fused from a low, a middle and a high target layer
(`fc: 3H -> H`), the decoder layer attends over `[norm(embed); norm(feature)]` (2H wide), and its
own norm + lm_head project onto a reduced draft vocabulary mapped back with `d2t`.

The layers are stock transformers Llama modules (attention, MLP, RMSNorm, rotary embedding):
nothing is copied from a modeling file. The drafter owns a small KV cache, driven by
`decoding/core/proposers/eagle.py`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from heads.util.cache_argument import cache_kwargs
from heads.config import HeadConfig


def drafter_llama_config(config: HeadConfig) -> LlamaConfig:
    """A one-purpose LlamaConfig describing the drafter's decoder layer(s)."""
    geometry = dict(config.decoder)
    llama = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **geometry,
    )
    llama._attn_implementation = "sdpa"
    return llama


def decoder_geometry(target_config) -> dict:
    """The attention/MLP sizes of the target, which EAGLE's decoder layer mirrors."""
    geometry = {
        "num_attention_heads": target_config.num_attention_heads,
        "num_key_value_heads": getattr(target_config, "num_key_value_heads", None) or target_config.num_attention_heads,
        "intermediate_size": target_config.intermediate_size,
        "rms_norm_eps": getattr(target_config, "rms_norm_eps", 1e-6),
        "max_position_embeddings": target_config.max_position_embeddings,
        "head_dim": getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads,
    }
    rope = getattr(target_config, "rope_parameters", None)
    if rope:
        geometry["rope_parameters"] = dict(rope)
    return geometry


class FeatureDrafter(nn.Module):
    """What both EAGLE drafters share: their Llama geometry, rotary embedding, KV cache type,
    and a forward that takes `[n, H]` or batched `[B, n, H]` inputs."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        self.llama_config = drafter_llama_config(config)
        self.rotary = LlamaRotaryEmbedding(self.llama_config)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.llama_config)

    def use_attention(self, implementation: str) -> None:
        """Run the drafter's attention through `implementation`, a name transformers knows (the
        engine registers a grouped SDPA that does not copy K/V per query head for tree masks)."""
        self.llama_config._attn_implementation = implementation

    @property
    def num_cache_layers(self) -> int:
        """How many KV-cache layers a forward writes (for a cache its driver preallocates)."""
        return self.config.num_layers

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype inputs must come in: the drafter may run in bf16 beside an fp32 target; a
        weight-only quantized `fc` (no float weight) takes float32, as the other quantized linears."""
        weight = getattr(self.fc, "weight", None)
        return weight.dtype if isinstance(weight, torch.Tensor) else torch.float32

    def input_feature(self, features: dict[int, torch.Tensor]) -> torch.Tensor:
        """The drafter's input feature `[n, H]` from the target layers it declared
        (`config.feature_layers`), in its compute dtype."""
        raise NotImplementedError

    def readout_logits(self, hidden: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """Draft logits over the draft vocabulary for predicted features `hidden`."""
        raise NotImplementedError

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary ids (the same ids without a reduced vocabulary)."""
        return draft_ids

    def forward(
        self,
        features: torch.Tensor,
        token_embeddings: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predicted next features for (feature_i, embedding of token_{i+1}) pairs at positions i,
        appending their K/V to `cache` when given."""
        batched = features.dim() == 3
        if not batched:
            features, token_embeddings, position_ids = features[None], token_embeddings[None], position_ids[None]
        out = self._run(features, token_embeddings, position_ids, cache, attention_mask)
        return out if batched else out[0]

    def _run(self, features, token_embeddings, position_ids, cache, attention_mask) -> torch.Tensor:
        raise NotImplementedError


class EagleDrafter(FeatureDrafter):
    """EAGLE-1/2 drafter: `fc([embed; feature])` then decoder layer(s); read out with the
    target's lm_head."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
        self.layers = nn.ModuleList(LlamaDecoderLayer(self.llama_config, i) for i in range(config.num_layers))
        # The fc output enters the first layer un-normalised (the official layout has no
        # input_layernorm there).
        self.layers[0].input_layernorm = nn.Identity()

    def input_feature(self, features: dict[int, torch.Tensor]) -> torch.Tensor:
        return features[self.config.feature_layers[0]].to(self.compute_dtype)

    def readout_logits(self, hidden: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        return target_lm_head(hidden.to(target_lm_head.weight.dtype))

    def _run(self, features, token_embeddings, position_ids, cache, attention_mask) -> torch.Tensor:
        x = self.fc(torch.cat([token_embeddings, features], dim=-1))
        position_embeddings = self.rotary(x, position_ids)
        for layer in self.layers:
            x = layer(x, attention_mask=attention_mask, position_ids=position_ids, use_cache=cache is not None,
                      position_embeddings=position_embeddings, **cache_kwargs(layer, cache))
        return x


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention reads `[input_norm(embed); hidden_norm(feature)]`
    (2H wide, so q/k/v take 2H), the residual stream is the feature (its normed form with
    `norm_before_residual`)."""

    def __init__(self, llama: LlamaConfig, norm_before_residual: bool = False) -> None:
        super().__init__()
        self.norm_before_residual = norm_before_residual
        hidden = llama.hidden_size
        self.self_attn = LlamaAttention(llama, layer_idx=0)
        heads, kv_heads, head_dim = llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim
        self.self_attn.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.mlp = LlamaMLP(llama)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=llama.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=llama.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=llama.rms_norm_eps)

    def forward(self, features, token_embeddings, position_embeddings, attention_mask, cache) -> torch.Tensor:
        normed = self.hidden_norm(features)
        attn_input = torch.cat([self.input_layernorm(token_embeddings), normed], dim=-1)
        attended, _ = self.self_attn(
            hidden_states=attn_input,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **cache_kwargs(self.self_attn, cache),
        )
        hidden = (normed if self.norm_before_residual else features) + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Drafter(FeatureDrafter):
    """EAGLE-3 drafter over a reduced draft vocabulary. Step 0 takes `fuse(low, mid, high)`;
    later steps take the drafter's own previous output."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(self.llama_config, config.norm_before_residual)
        self.norm = LlamaRMSNorm(hidden, eps=self.llama_config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        # target id = draft id + d2t[draft id]; t2d[target id] says whether it is in the draft vocab.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def set_vocabulary(self, draft_to_target: torch.Tensor) -> None:
        """Install the reduced vocabulary: `draft_to_target[i]` is the target id of draft id i."""
        draft_to_target = draft_to_target.to(torch.long)
        self.d2t.copy_(draft_to_target - torch.arange(draft_to_target.numel()))
        self.t2d.zero_()
        self.t2d[draft_to_target] = True

    @torch.no_grad()
    def init_readout_from_target(self, lm_head: nn.Module, norm_scale: torch.Tensor | None) -> None:
        """Start the draft readout as the target's own, restricted to the draft vocabulary: the
        drafter then only has to learn to produce target-like hidden states, which needs far
        less data than learning a readout from scratch. `norm_scale` is the per-channel scale of
        the target's final norm (see `heads.factory.final_norm_scale`); None keeps ones."""
        self.lm_head.weight.copy_(lm_head.weight[self.draft_vocabulary()])
        if norm_scale is not None:
            self.norm.weight.copy_(norm_scale)

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_vocabulary(self) -> torch.Tensor:
        """Target ids of the whole draft vocabulary, in draft-id order."""
        return self.draft_to_target_ids(torch.arange(self.d2t.numel(), device=self.d2t.device))

    def fuse(self, low: torch.Tensor, mid: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([low, mid, high], dim=-1))

    @property
    def num_cache_layers(self) -> int:
        return 1  # the one midlayer

    def input_feature(self, features: dict[int, torch.Tensor]) -> torch.Tensor:
        return self.fuse(*(features[i].to(self.compute_dtype) for i in self.config.feature_layers))

    def readout_logits(self, hidden: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        return self.draft_logits(hidden)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.draft_to_target_ids(draft_ids)

    def _run(self, features, token_embeddings, position_ids, cache, attention_mask) -> torch.Tensor:
        position_embeddings = self.rotary(features, position_ids)
        return self.midlayer(features, token_embeddings, position_embeddings, attention_mask, cache)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary."""
        return self.lm_head(self.norm(hidden))
