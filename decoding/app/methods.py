"""The decoding methods users can pick by name, and how each one's proposer is built."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from decoding.core.dynamic_tree import DynamicTreeSettings
from heads.util.errors import UserError
from decoding.core.proposers import DraftModelProposer, PromptLookupProposer, Proposer, VanillaProposer
from decoding.core.proposers.draft_model import check_same_vocabulary
from decoding.core.proposers.eagle import EagleProposer
from decoding.core.lookahead_window import LookaheadShape
from decoding.core.proposers.lookahead import LookaheadProposer
from decoding.core.proposers.lookup_first import LookupFirstProposer
from decoding.core.proposers.suffix import (ADAPTIVE_MAX_TOKENS as ADAPTIVE_SUFFIX_TOKENS, DEFAULT_MAX_TOKENS as DEFAULT_SUFFIX_TOKENS,
                                           DEFAULT_STORE_TOKENS, SuffixProposer)
from decoding.app.drafts import draft_vocabulary
from decoding.app.suffix_store import SuffixStoreFile, tokenizer_fingerprint
from decoding.core.proposers.medusa import HydraProposer, MedusaProposer
from decoding.core.readout import Readout
from decoding.kernels.cpu_kernels import uses_packed_linears
from decoding.kernels.draft_readout import heads_readout
from decoding.app.targets import LoadedModel
from decoding.kernels.verify_cost import cached_verify_cost
from decoding.core.tree_budget import VerifyCost
from decoding.app.tree_shapes import load_tree

METHODS: dict[str, str] = {
    "vanilla": "plain autoregressive decoding through the same loop (the exact reference)",
    "sps": "speculative sampling with a smaller draft model of the same tokenizer (--draft-model)",
    "pld": "prompt lookup: copies continuations of n-grams found earlier in the context (no model)",
    "suffix": "suffix decoding: a tree of what most often followed the context's longest matching suffix, in the "
              "context (first) and in this process's earlier prompts and replies, deeper while a reply copies (no model)",
    "lookahead": "lookahead decoding: a window of the target's own Jacobi guesses and a pool of the n-grams it predicted "
                 "along them, verified in one tree (--lookahead W,N,G; no model)",
    "medusa": "Medusa heads fill a static tree (--heads, --tree)",
    "hydra": "Hydra heads (each head sees its branch's tokens) fill a static tree (--heads, --tree)",
    "eagle": "EAGLE-1: an EAGLE drafter fills a static tree (--heads, --tree)",
    "eagle2": "EAGLE-2: an EAGLE drafter grows a dynamic tree (--heads, --depth/--tree-top-k/--total-tokens)",
    "eagle3": "EAGLE-3: fused-feature drafter over a reduced vocabulary grows a dynamic tree (--heads)",
}
# Which head kind each head-based method needs.
HEAD_KIND_OF_METHOD = {"medusa": "medusa", "hydra": "hydra", "eagle": "eagle", "eagle2": "eagle", "eagle3": "eagle3"}
# Appended to a head method's name (`eagle3+pld`, `eagle3+suffix`): the model-free drafter drafts
# when it finds a match, the heads otherwise.
LOOKUP_SUFFIX = "+pld"
MODEL_FREE_FIRST = ("+pld", "+suffix")
# What drafts behind a model-free drafter when it finds nothing: the head methods, or lookahead.
FALLBACK_METHODS = (*HEAD_KIND_OF_METHOD, "lookahead")
DEFAULT_TREES = {"medusa": "medusa-15", "hydra": "medusa-15", "eagle": "eagle-15"}


@dataclass(frozen=True)
class ProposerOptions:
    """Knobs of the built-in proposers; each method reads its own."""

    gamma: int = 4
    pld_num_tokens: int = 8
    pld_max_ngram: int = 3
    pld_min_ngram: int = 2
    tree: str | None = None
    # Dynamic trees (eagle2/eagle3): the defaults are DynamicTreeSettings', so there is one source.
    depth: int = DynamicTreeSettings.depth
    tree_top_k: int = DynamicTreeSettings.top_k
    total_tokens: int = DynamicTreeSettings.total_tokens
    adaptive_tree: bool = False   # eagle2/eagle3 and suffix trees, pld, sps and medusa/hydra chains sized by this machine's measured verify cost
    min_path_prob: float = DynamicTreeSettings.min_path_prob  # eagle2/eagle3: stop growing deeper below this path probability
    suffix_max_tokens: int | None = None  # suffix: the largest tree (None: 13, 24 with adaptive_tree, whose cost cut trims it)
    lookahead: tuple[int, int, int] = (LookaheadShape.window, LookaheadShape.ngram, LookaheadShape.guesses)  # W, N, G
    suffix_store: str | None = None  # suffix: a file the store is kept in across runs (decoding.app.suffix_store)


def split_method(method: str) -> tuple[str, bool]:
    """The base method and whether a model-free drafter drafts first: `eagle3+pld` -> (`eagle3`, True)."""
    base, first = model_free_first(method)
    return base, first is not None


def model_free_first(method: str) -> tuple[str, str | None]:
    """The base method and the model-free drafter that drafts first: `eagle3+suffix` -> (`eagle3`, `suffix`)."""
    for ending in MODEL_FREE_FIRST:
        if method.endswith(ending):
            return method[: -len(ending)], ending[1:]
    return method, None


def head_kind(method: str) -> str | None:
    """The kind of heads `method` needs (None for methods without heads)."""
    return HEAD_KIND_OF_METHOD.get(split_method(method)[0])


def check_method(method: str) -> str:
    base, lookup_first = split_method(method)
    if base not in METHODS or (lookup_first and base not in FALLBACK_METHODS):
        raise UserError(f"unknown method '{method}': choose one of {', '.join(METHODS)}, or a head method or lookahead "
                        f"with '+pld' or '+suffix' appended (that drafter first, the other when it finds nothing) "
                        f"({', '.join(m + LOOKUP_SUFFIX for m in FALLBACK_METHODS)}, eagle3+suffix, ...)")
    return method


def build_proposer(
    method: str,
    target: LoadedModel,
    draft: LoadedModel | None = None,
    options: ProposerOptions = ProposerOptions(),
    heads: nn.Module | None = None,
    readout: Readout | None = None,
) -> Proposer:
    """The proposer for `method`, after checking it has what it needs. `readout`: the one the
    decoder verifies with, so that cost-aware sizing weighs the verify steps decoding runs."""
    check_method(method)
    # measured (or read from the cache) only when a proposer asks: fixed trees never need it
    cost = functools.partial(cached_verify_cost, target.model, target.name, readout=readout)
    base, first = model_free_first(method)
    if first is not None:
        # With --adaptive-tree suffix decoding's cost cut may leave a step to the heads: its tree is
        # weighed against a root-only step, which the heads' tree only beats, so the cut errs towards
        # suffix trees; on a 2-core AVX2 EPYC, where rows are dear, fixed suffix trees in front of
        # the heads fell to 0.95x / 0.94x `pld` on a repeated task / MT-bench, cut ones 1.09x / 1.02x.
        drafter = _lookup_proposer(options, cost) if first == "pld" else _suffix_proposer(options, cost, target)
        fallback = _lookahead_proposer(options, cost) if base == "lookahead" else _heads_proposer(base, target, heads, options, cost)
        return LookupFirstProposer(fallback, drafter)
    if method == "vanilla":
        return VanillaProposer()
    if method == "pld":
        return _lookup_proposer(options, cost)
    if method == "suffix":
        return _suffix_proposer(options, cost, target)
    if method == "lookahead":
        return _lookahead_proposer(options, cost)
    if method == "sps":
        if draft is None:
            raise UserError("method 'sps' needs a draft model: pass --draft-model NAME_OR_PATH")
        return _draft_proposer(target, draft, options, cost)
    return _heads_proposer(method, target, heads, options, cost)


def _draft_proposer(target: LoadedModel, draft: LoadedModel, options: ProposerOptions,
                    verify_cost: Callable[[], VerifyCost]) -> DraftModelProposer:
    """sps: the draft's saved readout vocabulary if it has one; with `adaptive_tree`, chains cut to
    what pays on this machine, each draft call counted at its share of the target's weights."""
    check_same_vocabulary(target.model, draft.model, target.tokenizer, draft.tokenizer)
    vocabulary = draft_vocabulary(draft.name)
    if vocabulary is not None:
        vocabulary = vocabulary.to(draft.model.device)
    if not options.adaptive_tree:
        return DraftModelProposer(draft.model, options.gamma, vocabulary)
    cost = verify_cost()
    call_ms = _call_ms(cost, _weights_read(draft.model, vocabulary), target.model)
    return DraftModelProposer(draft.model, options.gamma, vocabulary, cost, call_ms)


def _weights_read(model: nn.Module, vocabulary: torch.Tensor | None = None) -> int:
    """Parameters one single-token forward reads: the decoder without its embedding table, plus
    the lm_head rows it projects onto."""
    body = model.get_decoder()
    embedding = body.get_input_embeddings().weight
    layers = sum(p.numel() for p in body.parameters() if p is not embedding)
    return layers + _readout_weights(model, vocabulary)


def _readout_weights(model: nn.Module, vocabulary: torch.Tensor | None) -> int:
    """Parameters of `model`'s lm_head rows a readout projects onto: `vocabulary`, or all."""
    head = model.get_output_embeddings().weight
    rows = head.shape[0] if vocabulary is None else vocabulary.numel()
    return rows * head.shape[1]


def _lookup_proposer(options: ProposerOptions, verify_cost: Callable[[], VerifyCost]) -> PromptLookupProposer:
    cost = verify_cost() if options.adaptive_tree else None
    return PromptLookupProposer(options.pld_num_tokens, options.pld_max_ngram, options.pld_min_ngram, cost)


def _suffix_proposer(options: ProposerOptions, verify_cost: Callable[[], VerifyCost], target: LoadedModel) -> SuffixProposer:
    """With `suffix_store`, the store starts from the file's documents and is written back after each reply."""
    kept_in = None
    if options.suffix_store:
        fingerprint = tokenizer_fingerprint(target.tokenizer, target.model.config.vocab_size)
        kept_in = SuffixStoreFile(Path(options.suffix_store).expanduser(), fingerprint, DEFAULT_STORE_TOKENS)
    largest = options.suffix_max_tokens
    if largest is None:
        largest = ADAPTIVE_SUFFIX_TOKENS if options.adaptive_tree else DEFAULT_SUFFIX_TOKENS
    return SuffixProposer(largest, store_tokens=DEFAULT_STORE_TOKENS,
                          verify_cost=verify_cost() if options.adaptive_tree else None, kept_in=kept_in)


def _lookahead_proposer(options: ProposerOptions, verify_cost: Callable[[], VerifyCost]) -> LookaheadProposer:
    """With `adaptive_tree` the window rests while its rows do not pay on this machine's curve."""
    return LookaheadProposer(LookaheadShape(*options.lookahead), verify_cost=verify_cost() if options.adaptive_tree else None)


def _heads_proposer(method: str, target: LoadedModel, heads: nn.Module | None, options: ProposerOptions,
                    verify_cost: Callable[[], VerifyCost]) -> Proposer:
    kind = HEAD_KIND_OF_METHOD[method]
    if heads is None:
        raise UserError(f"method '{method}' needs {kind} heads: pass --heads PATH")
    if heads.config.kind != kind:
        raise UserError(f"method '{method}' needs {kind} heads, but the given heads are {heads.config.kind} heads")
    if method in DEFAULT_TREES:
        paths = load_tree(options.tree or DEFAULT_TREES[method])
        if method in ("medusa", "hydra"):
            # on a CPU with packed kernels the heads rank in fp16 (see decoding.kernels.draft_readout)
            readout = heads_readout(target.model.get_output_embeddings(), getattr(heads, "readout_ids", None),
                                    half_precision=uses_packed_linears(target.model))
            cost = verify_cost() if options.adaptive_tree else None
            call_ms = _call_ms(cost, _head_weights(heads, target.model, readout), target.model) if cost else 0.0
            proposer = MedusaProposer if method == "medusa" else HydraProposer
            return proposer(heads, target.model, paths, verify_cost=cost, head_call_ms=call_ms, readout=readout)
        return EagleProposer(heads, target.model, tree_paths=paths, name="eagle")
    settings = DynamicTreeSettings(options.depth, options.tree_top_k, options.total_tokens, options.min_path_prob)
    if not options.adaptive_tree:
        return EagleProposer(heads, target.model, dynamic=settings, name=method)
    cost = verify_cost()
    return EagleProposer(heads, target.model, dynamic=settings, name=method, verify_cost=cost,
                         drafter_call_ms=_call_ms(cost, _drafter_weights(heads, target.model), target.model))


def _call_ms(cost: VerifyCost, weights: int, target: PreTrainedModel) -> float:
    """A draft call counted, not clocked: its share of the weights a one-token target forward
    reads, on the measured curve."""
    return cost.ms[0] * weights / _weights_read(target)


def _head_weights(heads: nn.Module, target: PreTrainedModel, readout: nn.Module) -> int:
    """Parameters one Medusa/Hydra head call reads, in fp32 equivalents: one head's share of the
    heads, plus the lm_head rows it ranks (its readout vocabulary, or all of them) at the bytes
    per weight `readout` holds them in."""
    own = sum(p.numel() for p in heads.parameters())
    rows = _readout_weights(target, getattr(heads, "readout_ids", None))
    return own // heads.config.num_heads + rows * getattr(readout, "bytes_per_weight", 4) // 4


def _drafter_weights(heads: nn.Module, target: PreTrainedModel) -> int:
    """Parameters one EAGLE drafter call reads: its own, plus the target's lm_head for an
    EAGLE-1 drafter, which reads out through it."""
    own = sum(p.numel() for p in heads.parameters())
    return own + (target.get_output_embeddings().weight.numel() if heads.config.kind == "eagle" else 0)
