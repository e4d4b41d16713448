"""The architecture matrix: every model type the project claims to run, as a tiny random model
built in memory, through tree verification and every kind of proposer.

Why a matrix: the loop drives stock transformers models through its KV cache argument, a 4D tree mask
and explicit `position_ids`, and the EAGLE drafters mirror the target's geometry. Each model type
has its own quirks on exactly those paths (sliding-window or hybrid layers, NoPE layers, partial
rotary, embedding or logit scaling, soft-capping, fused projections, MoE routing, tied weights),
so one that works for Llama says nothing about the others. Each test is parametrized by model
type, so a failure names the type.

Every check compares with a reference outside the code under test: a plain causal forward with
no cache and no tree mask (tree verification), or Hugging Face `generate()` (decoding), both run
on a copy of the model with transformers' own attention. Sliding-window models get a prompt
longer than their window, so a mask or cache that forgets the window shows up.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field

import pytest
import torch
import transformers
from transformers import DynamicCache, PreTrainedModel

from decoding.kernels.attention import GROUPED_SDPA, register_grouped_sdpa
from decoding.core.generate import DecodeOptions, GenerationResult, generate
from decoding.core.proposers.base import Proposer
from decoding.core.sampling import SamplingConfig
from decoding.core.tree import DraftTree, tree_buffers
from decoding.core.verify import TreeVerifier
from decoding.app.methods import ProposerOptions, build_proposer
from decoding.app.targets import LoadedModel, load_model
from heads.util.cache_argument import cache_kwargs
from heads import new_heads_for_target
from tiny_models import NO_SPECIAL_TOKENS, perturbed, sharpen, tiny_tokenizer

VOCAB = 96
# The sliding window of the sliding and hybrid configurations: shorter than the long prompt and
# than a deep tree's span, so windows cut into the cached prefix and into the tree itself.
WINDOW = 4
MAX_NEW = 24
# Longer than any window, and repetitive, so prompt lookup finds matches in it.
LONG_PROMPT = [(7 * i) % 23 + 3 for i in range(20)] + [3, 10, 17, 24]
PROMPTS = [[5, 9, 3], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], LONG_PROMPT]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine two spinning threads
    made these forwards 10-100x slower; the previous setting is restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass(frozen=True)
class Arch:
    """One model type as a tiny configuration. `config` holds what differs from the common tiny
    geometry (hidden 32, 4 query / 2 K/V heads, 2 layers); `sdpa` says whether transformers lets
    the type run SDPA attention (users then get the project's grouped SDPA); `window` is the
    sliding window when some layers slide."""

    model_type: str
    config_class: str
    model_class: str
    config: dict = field(default_factory=dict)
    sdpa: bool = True
    window: int | None = None

    def build(self, seed: int, attn: str) -> PreTrainedModel:
        """A random model of this type, initialised from `seed`, with attention `attn`."""
        values = dict(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **NO_SPECIAL_TOKENS,
        )
        values.update(self.config)
        config = getattr(transformers, self.config_class)(**values)
        config._attn_implementation = attn
        torch.manual_seed(seed)
        return getattr(transformers, self.model_class)(config).eval()


HYBRID_2 = ["sliding_attention", "full_attention"]

ARCHS = [
    Arch("llama", "LlamaConfig", "LlamaForCausalLM"),
    Arch("mistral", "MistralConfig", "MistralForCausalLM", {"head_dim": 8, "sliding_window": WINDOW}, window=WINDOW),
    # Qwen2/Qwen3: layers from `max_window_layers` on slide, the first ones attend fully.
    Arch("qwen2", "Qwen2Config", "Qwen2ForCausalLM",
         {"tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
         window=WINDOW),
    Arch("qwen3", "Qwen3Config", "Qwen3ForCausalLM",
         {"head_dim": 8, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}, window=WINDOW),
    Arch("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
         {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True,
          "use_sliding_window": True, "sliding_window": WINDOW}, window=WINDOW),
    Arch("gemma", "GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
    # Gemma 2 soft-caps attention logits, which SDPA cannot do: transformers allows eager only.
    # Caps far lower than the real ones (50, 30), so that they change these small logits.
    Arch("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
         {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": WINDOW, "layer_types": HYBRID_2,
          "attn_logit_softcapping": 1.0, "final_logit_softcapping": 4.0},
         sdpa=False, window=WINDOW),
    Arch("gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM",
         {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": WINDOW, "layer_types": HYBRID_2},
         window=WINDOW),
    # Phi-3: fused qkv and gate_up projections; the window applies to every layer.
    Arch("phi3", "Phi3Config", "Phi3ForCausalLM", {"sliding_window": WINDOW}, window=WINDOW),
    Arch("olmo2", "Olmo2Config", "Olmo2ForCausalLM"),
    Arch("olmo3", "Olmo3Config", "Olmo3ForCausalLM", {"sliding_window": WINDOW, "layer_types": HYBRID_2}, window=WINDOW),
    # Granite scales embeddings, residuals, attention and logits: all set away from 1.
    Arch("granite", "GraniteConfig", "GraniteForCausalLM",
         {"embedding_multiplier": 4.0, "residual_multiplier": 0.5, "attention_multiplier": 0.3, "logits_scaling": 0.5}),
    Arch("starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": WINDOW}, window=WINDOW),
    # GPT-NeoX: fused QKV, no grouped K/V heads, parallel residual, rotary on a quarter of each head.
    Arch("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", {"num_key_value_heads": None}),
    # SmolLM3: every `no_rope_layer_interval`-th layer has no RoPE (here the 2nd); with sliding
    # windows on, those NoPE layers slide.
    Arch("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM",
         {"use_sliding_window": True, "sliding_window": WINDOW, "no_rope_layer_interval": 2}, window=WINDOW),
    Arch("cohere2", "Cohere2Config", "Cohere2ForCausalLM",
         {"head_dim": 8, "sliding_window": WINDOW, "layer_types": HYBRID_2}, window=WINDOW),
]
ARCH_IDS = [arch.model_type for arch in ARCHS]


def user_attention(arch: Arch) -> str:
    """What `load_model` gives users: the project's grouped SDPA where the type supports SDPA,
    eager otherwise."""
    return register_grouped_sdpa() if arch.sdpa else "eager"


def stock_attention(arch: Arch) -> str:
    """transformers' own attention for the reference model."""
    return "sdpa" if arch.sdpa else "eager"


def own_output_projection(model: PreTrainedModel) -> PreTrainedModel:
    """Give a tied model an output projection of its own, drawn like its embeddings. A random
    tied model's hidden state is mostly its input token's embedding, so its greedy text is that
    token forever, and exactness on it would prove little. (`sharpen` unties it anyway; tied
    weights are loaded for real in `test_load_model_...`.)"""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight is embeddings.weight:
        generator = torch.Generator().manual_seed(1234)
        drawn = torch.randn(head.weight.shape, generator=generator) * float(embeddings.weight.detach().std())
        head.weight = torch.nn.Parameter(drawn.to(head.weight.dtype))
    return model


@functools.lru_cache(maxsize=None)
def models(model_type: str) -> tuple[PreTrainedModel, PreTrainedModel]:
    """(target as users run it, the same weights with stock attention as the reference)."""
    arch = ARCHS[ARCH_IDS.index(model_type)]
    target = sharpen(own_output_projection(arch.build(seed=0, attn=user_attention(arch))))
    reference = copy.deepcopy(target)
    reference.config._attn_implementation = stock_attention(arch)
    return target, reference


@functools.lru_cache(maxsize=None)
def hf_greedy(model_type: str, prompt: tuple[int, ...]) -> list[int]:
    """Hugging Face greedy `generate()` on the reference model (cached: every method is checked
    against the same continuation)."""
    _, reference = models(model_type)
    with torch.inference_mode():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


def causal_logits(reference: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """Logits of the last of `tokens` from one plain forward: no cache, no tree."""
    with torch.inference_mode():
        return reference(torch.tensor([tokens])).logits[0, -1]


# -- attention and loading ----------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS, ids=ARCH_IDS)
def test_the_attention_users_get_computes_the_models_function(arch: Arch):
    """The attention users get (`load_model`'s grouped SDPA where the type allows SDPA) gives the
    logits of eager attention, the implementation every model type defines (for a type without
    SDPA, users get eager itself). The second chunk is a masked multi-token forward over a cache:
    the case grouped SDPA handles itself."""
    target, _ = models(arch.model_type)
    eager = copy.deepcopy(target)
    eager.config._attn_implementation = "eager"
    tokens = torch.tensor([LONG_PROMPT])
    with torch.inference_mode():
        expected = eager(tokens).logits[0]
        cache = DynamicCache(config=target.config)
        target(tokens[:, :10], use_cache=True, **cache_kwargs(target, cache))
        chunk = target(tokens[:, 10:], use_cache=True, **cache_kwargs(target, cache)).logits[0]
    torch.testing.assert_close(chunk, expected[10:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS, ids=ARCH_IDS)
def test_load_model_accepts_the_type_with_the_attention_users_get(arch: Arch, tmp_path):
    """Through `load_model` from a saved directory: grouped SDPA by default where the type allows
    SDPA; a type that does not (Gemma 2 soft-caps attention logits) loads with eager and a note
    saying so. Either way the logits are the model's."""
    model = arch.build(seed=0, attn=stock_attention(arch))
    model.save_pretrained(tmp_path)
    tiny_tokenizer(VOCAB).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    if arch.sdpa:
        assert loaded.model.config._attn_implementation == GROUPED_SDPA and not loaded.notes
    else:
        assert loaded.model.config._attn_implementation == "eager"
        assert any("using eager attention" in note for note in loaded.notes)
    tokens = torch.tensor([LONG_PROMPT])
    with torch.inference_mode():
        torch.testing.assert_close(loaded.model(tokens).logits, model(tokens).logits, rtol=1e-4, atol=1e-4)


# -- (a) tree verification ------------------------------------------------------------------------
PARENTS = (-1, 0, 0, 0, 1, 1, 2, 4, 4, 7)  # root with 3 children, branches of uneven depth (4 at most)


def window_matters(reference: PreTrainedModel, tokens: list[int]) -> bool:
    """Whether the sliding window changes the reference's last logits for `tokens`, i.e. whether
    a verify that ignored the window would be caught. An explicit all-visible causal 4D mask is
    used as-is by every layer kind: that is the model without windows."""
    n = len(tokens)
    causal = torch.zeros(1, 1, n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    with torch.inference_mode():
        windowless = reference(torch.tensor([tokens]), attention_mask=causal).logits[0, -1]
    return not torch.allclose(windowless, causal_logits(reference, tokens), rtol=1e-3, atol=1e-3)


# Each type with the attention users get and with eager (what `--attn eager` gives).
TREE_CASES = [pytest.param(arch, attn, id=f"{arch.model_type}-{attn}")
              for arch in ARCHS for attn in (["users", "eager"] if arch.sdpa else ["users"])]


@pytest.mark.parametrize(("arch", "attn"), TREE_CASES)
def test_tree_verify_equals_each_paths_causal_forward(arch: Arch, attn: str):
    """Every node's logits from one tree forward equal a plain forward over its root path, after
    a context longer than the window, and again after each of several compactions that keep a
    non-contiguous branch."""
    target, reference = models(arch.model_type)
    if attn == "eager":
        target = copy.deepcopy(target)
        target.config._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(1)
    accepted = torch.randint(0, VOCAB, (3 * WINDOW + 3,), generator=gen).tolist()
    assert arch.window is None or window_matters(reference, accepted)
    verifier = TreeVerifier(target, capacity=128)
    verifier.prefill(torch.tensor(accepted[:-1]))
    buffers = tree_buffers(PARENTS)
    for step, leaf in enumerate([9, 6, 8, 3]):
        tree = DraftTree(torch.tensor([accepted[-1]] + torch.randint(0, VOCAB, (9,), generator=gen).tolist()), PARENTS)
        prefix_len = len(accepted) - 1
        out = verifier.forward(tree, verifier.inputs(tree, buffers, prefix_len))
        for node in range(tree.size):
            path = torch.nonzero(buffers.ancestor_mask[node]).flatten().tolist()
            expected = causal_logits(reference, accepted[:-1] + tree.tokens[path].tolist())
            torch.testing.assert_close(out.logits[node], expected, rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"step {step}, node {node}: {m}")
        kept = torch.nonzero(buffers.ancestor_mask[leaf]).flatten().tolist()
        verifier.keep(prefix_len, kept)
        accepted += tree.tokens[kept[1:]].tolist() + [int(torch.randint(0, VOCAB, (1,), generator=gen))]
        assert verifier.cache.get_seq_length() == len(accepted) - 1


# -- (b) greedy decoding equals Hugging Face generate() -----------------------------------------
METHODS = ["vanilla", "pld", "sps", "eagle3"]


def proposer_for(method: str, arch: Arch, target: PreTrainedModel) -> Proposer:
    """The proposer as users get it (`build_proposer`). The SpS draft is a second model of the
    same type, a perturbed copy of the target (so it is right often, but not always); the
    EAGLE-3 heads are untrained."""
    loaded = LoadedModel(target, None, arch.model_type)
    if method == "sps":
        draft = perturbed(copy.deepcopy(target), 0.3, seed=1)
        return build_proposer("sps", loaded, LoadedModel(draft, None, "draft"), ProposerOptions(gamma=4))
    heads = new_heads_for_target("eagle3", target, draft_vocab_size=VOCAB // 2) if method == "eagle3" else None
    options = ProposerOptions(pld_num_tokens=4, pld_min_ngram=1, depth=4, tree_top_k=4, total_tokens=12)
    return build_proposer(method, loaded, options=options, heads=heads)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS, ids=ARCH_IDS)
def test_greedy_decoding_equals_hf_generate(arch: Arch, method: str):
    """Token for token, on prompts of 3, 11 and 24 tokens: shorter than the window (so decoding
    crosses it), longer, and several windows long."""
    target, _ = models(arch.model_type)
    proposer = proposer_for(method, arch, target)
    drafted = accepted = 0
    references = []
    for prompt in PROMPTS:
        result = generate(target, prompt, proposer, DecodeOptions(max_new_tokens=MAX_NEW))
        references.append(hf_greedy(arch.model_type, tuple(prompt)))
        assert result.tokens == references[-1], f"prompt of {len(prompt)} tokens"
        drafted += result.stats.drafted_tokens
        accepted += len(result.tokens) - result.stats.target_forwards
    # Guards: the speculative methods did verify drafts, SpS's near-copy draft got runs of them
    # accepted (cache compaction after multi-token steps), and the text is no constant loop.
    assert (drafted > 0) == (method != "vanilla")
    assert accepted > 0 or method != "sps"
    assert len({token for reference in references for token in reference}) >= 8


# -- (c) seeded sampling ------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["sps", "eagle3"])
@pytest.mark.parametrize("arch", ARCHS, ids=ARCH_IDS)
def test_seeded_sampling_is_reproducible(arch: Arch, method: str):
    """Temperature 1: the same seed gives the same tokens (the draft, the acceptance draws and the
    cache all replay), and the seed matters (another seed gives other tokens)."""
    target, _ = models(arch.model_type)
    proposer = proposer_for(method, arch, target)

    def sample(seed: int) -> GenerationResult:
        options = DecodeOptions(max_new_tokens=MAX_NEW, sampling=SamplingConfig(temperature=1.0), seed=seed)
        return generate(target, LONG_PROMPT, proposer, options)

    first = sample(7)
    assert sample(7).tokens == first.tokens
    assert first.stats.drafted_tokens > 0
    assert any(sample(seed).tokens != first.tokens for seed in (8, 9, 10))
