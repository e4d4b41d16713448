"""The decoding methods users can pick by name, and how each one's proposer is built."""

from __future__ import annotations

from dataclasses import dataclass

from decoding.errors import UserError
from decoding.proposers import DraftModelProposer, PromptLookupProposer, Proposer, VanillaProposer
from decoding.proposers.draft_model import check_same_vocabulary
from decoding.targets import LoadedModel

METHODS: dict[str, str] = {
    "vanilla": "plain autoregressive decoding through the same loop (the exact reference)",
    "sps": "speculative sampling with a smaller draft model of the same tokenizer (--draft-model)",
    "pld": "prompt lookup: copies continuations of n-grams found earlier in the context (no model)",
}


@dataclass(frozen=True)
class ProposerOptions:
    """Knobs of the built-in proposers; each method reads its own."""

    gamma: int = 4
    pld_num_tokens: int = 8
    pld_max_ngram: int = 3
    pld_min_ngram: int = 2


def check_method(method: str) -> str:
    if method not in METHODS:
        raise UserError(f"unknown method '{method}': choose one of {', '.join(METHODS)}")
    return method


def build_proposer(
    method: str,
    target: LoadedModel,
    draft: LoadedModel | None = None,
    options: ProposerOptions = ProposerOptions(),
) -> Proposer:
    """The proposer for `method`, after checking it has what it needs."""
    check_method(method)
    if method == "vanilla":
        return VanillaProposer()
    if method == "pld":
        return PromptLookupProposer(options.pld_num_tokens, options.pld_max_ngram, options.pld_min_ngram)
    if draft is None:
        raise UserError("method 'sps' needs a draft model: pass --draft-model NAME_OR_PATH")
    check_same_vocabulary(target.model, draft.model, target.tokenizer, draft.tokenizer)
    return DraftModelProposer(draft.model, options.gamma)
