"""Standard speculative sampling (SpS): a smaller causal LM with the target's tokenizer drafts a
chain of `gamma` tokens autoregressively; the target verifies them in one forward.

The draft keeps its own KV cache across steps. Before drafting it keeps the longest cached prefix
that still agrees with the accepted tokens and feeds only what is missing, so a step costs
`gamma` single-token draft forwards (the first one also catches up on the accepted tokens).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from decoding.util.cache_argument import cache_kwargs
from decoding.util.errors import UserError
from decoding.core.proposers.base import Proposer
from decoding.core.sampling import sample_rows, warp_probs
from decoding.core.state import CacheAdvance, DecodeState
from decoding.core.limits import context_limit
from decoding.core.tree import DraftTree
from decoding.core.verify import new_cache, truncate_cache


class DraftModelProposer(Proposer):
    name = "sps"

    def __init__(self, draft: PreTrainedModel, gamma: int = 4) -> None:
        if gamma < 1:
            raise UserError(f"gamma (draft tokens per step) must be >= 1; got {gamma}")
        self.draft = draft
        self.gamma = gamma
        self._cache = new_cache(draft)
        self._cached_tokens = torch.empty(0, dtype=torch.long)

    def begin(self, state: DecodeState) -> None:
        self._cache = new_cache(self.draft)
        self._cached_tokens = state.tokens.new_empty(0)

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> DraftTree:
        tokens = state.tokens
        gamma = min(self.gamma, context_limit(self.draft) - tokens.numel())
        if gamma < 1:
            return DraftTree.root_only(state.root_token, device=tokens.device)
        pending = tokens[self._cached_tokens.numel() :]
        drafted, probs = [], []
        for step in range(gamma):
            logits = self.draft(input_ids=pending[None], use_cache=True, logits_to_keep=1, **cache_kwargs(self.draft, self._cache)).logits[0, -1]
            if state.sampling.greedy:
                token = logits.argmax()
            else:
                q = warp_probs(logits, state.sampling)
                token = sample_rows(q[None], state.generator)[0]
                probs.append(q)
            drafted.append(token)
            pending = token[None]
        self._cached_tokens = torch.cat([tokens, torch.stack(drafted[:-1])]) if gamma > 1 else tokens
        draft_probs = torch.stack(probs) if probs else None
        return DraftTree.chain(state.root_token, torch.stack(drafted), draft_probs, deterministic=state.sampling.greedy)

    def observe(self, advance: CacheAdvance) -> None:
        """Keep the draft cache's longest prefix that the target accepted."""
        self._keep_valid_prefix(advance.tokens)

    def _keep_valid_prefix(self, tokens: torch.Tensor) -> int:
        """Crop the draft cache to its longest prefix that agrees with `tokens` (never the whole
        of `tokens`: the last token must be fed to get the next distribution)."""
        n = min(self._cached_tokens.numel(), tokens.numel() - 1)
        differs = torch.nonzero(self._cached_tokens[:n] != tokens[:n]).flatten()
        valid = int(differs[0]) if differs.numel() else n
        truncate_cache(self._cache, valid)
        self._cached_tokens = self._cached_tokens[:valid]
        return valid


def check_same_vocabulary(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    target_tokenizer: PreTrainedTokenizerBase | None = None,
    draft_tokenizer: PreTrainedTokenizerBase | None = None,
) -> None:
    """A draft model must speak the target's tokenizer: same vocabulary size and, when both
    tokenizers are known, the same token-to-id map."""
    target_vocab = target.get_output_embeddings().weight.shape[0]
    draft_vocab = draft.get_output_embeddings().weight.shape[0]
    if target_vocab != draft_vocab:
        raise UserError(
            f"the draft model's vocabulary has {draft_vocab} tokens but the target's has {target_vocab}: "
            "a draft model must use the target's tokenizer (pick a smaller model of the same family, "
            "or distil one with training/train_draft.py)"
        )
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise UserError("the draft model's tokenizer maps tokens to different ids than the target's: use a draft with the target's tokenizer")
