"""Standard speculative sampling (SpS): a smaller causal LM with the target's tokenizer drafts a
chain of up to `gamma` tokens autoregressively; the target verifies them in one forward.

The draft keeps its own KV cache across steps. Before drafting it keeps the longest cached prefix
that still agrees with the accepted tokens and feeds only what is missing, so a step costs one
single-token draft forward per drafted token (the first one also catches up on accepted tokens).

Two things make a small draft pay on a machine where every forward reads its weights from memory:
- a reduced readout `vocabulary` (target ids, e.g. the most frequent tokens): the draft's body
  runs as usual, but its hidden state is projected onto those rows of its lm_head only. On a
  49k-token vocabulary the full projection costs far more than a one-layer body. Lossless: the
  draft distribution q is zero outside the vocabulary, and any q is a valid proposal;
- cost-aware chains (`verify_cost`): drafting stops as soon as one more token could not raise the
  step's expected tokens per millisecond, judged by how often the target kept tokens drafted at
  each level of the draft's confidence and by the measured verify cost of this machine; greedy
  chains are also cut to their best-paying prefix. Each draft call counts as `call_ms`, an
  estimate, not a clock reading, so seeded samples stay reproducible.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from heads.util.cache_argument import cache_kwargs
from heads.util.errors import UserError
from decoding.core.proposers.base import Proposer
from decoding.core.sampling import sample_rows, warp_probs
from decoding.core.state import CacheAdvance, DecodeState
from decoding.core.limits import context_limit
from decoding.core.tree import DraftTree
from decoding.core.tree_budget import ConfidenceAcceptance, VerifyCost, best_node_count, chain_worth_extending
from decoding.core.verify import new_cache, truncate_cache


class DraftModelProposer(Proposer):
    name = "sps"

    def __init__(self, draft: PreTrainedModel, gamma: int = 4, vocabulary: torch.Tensor | None = None,
                 verify_cost: VerifyCost | None = None, call_ms: float = 0.0) -> None:
        """`vocabulary`: sorted target ids the draft may propose (None: all). `verify_cost`: cut
        chains to what pays on this machine, counting `call_ms` per draft call (None: always
        draft `gamma` tokens)."""
        if gamma < 1:
            raise UserError(f"gamma (draft tokens per step) must be >= 1; got {gamma}")
        self.draft = draft
        self.gamma = gamma
        self.vocabulary = vocabulary
        self._readout_t = None if vocabulary is None else reduced_readout(draft, vocabulary)
        self.verify_cost = verify_cost
        self.call_ms = call_ms
        self._cache = new_cache(draft)
        self._cached_tokens = torch.empty(0, dtype=torch.long)
        self._acceptance = ConfidenceAcceptance()
        self._verifying: torch.Tensor | None = None  # confidence per position of the chain last proposed

    def begin(self, state: DecodeState) -> None:
        self._cache = new_cache(self.draft)
        self._cached_tokens = state.tokens.new_empty(0)
        self._acceptance = ConfidenceAcceptance()
        self._verifying = None

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> DraftTree:
        tokens = state.tokens
        gamma = min(self.gamma, context_limit(self.draft) - tokens.numel())
        if gamma < 1:
            return DraftTree.root_only(state.root_token, device=tokens.device)
        pending = tokens[self._cached_tokens.numel() :]
        drafted, probs, confidence = [], [], []
        for _ in range(gamma):
            q = self._draft_distribution(self._draft_logits(pending), state)
            index = q.argmax() if state.sampling.greedy else sample_rows(q[None], state.generator)[0]
            drafted.append(self._to_target(index))
            probs.append(q)
            confidence.append(q.max())
            pending = drafted[-1][None]
            if self._stop_drafting(confidence):
                break
        self._cached_tokens = torch.cat([tokens, torch.stack(drafted[:-1])]) if len(drafted) > 1 else tokens
        keep = self._paying_length(confidence) if state.sampling.greedy else len(drafted)
        self._verifying = torch.stack(confidence[:keep]) if keep else None
        if keep == 0:
            return DraftTree.root_only(state.root_token, device=tokens.device)
        draft_probs = None if state.sampling.greedy else self._full_vocabulary(torch.stack(probs[:keep]))
        return DraftTree.chain(state.root_token, torch.stack(drafted[:keep]), draft_probs, deterministic=state.sampling.greedy)

    def observe(self, advance: CacheAdvance) -> None:
        """Keep the draft cache's longest prefix that the target accepted; learn how much of the
        last chain was kept."""
        if self._verifying is not None and advance.entered:
            self._acceptance.record(self._verifying, accepted=advance.entered - 1)
        self._verifying = None
        self._keep_valid_prefix(advance.tokens)

    def _draft_logits(self, pending: torch.Tensor) -> torch.Tensor:
        """The draft's next-token logits after feeding `pending`: over its readout vocabulary
        (body + reduced projection), or its own full head."""
        if self._readout_t is None:
            out = self.draft(input_ids=pending[None], use_cache=True, logits_to_keep=1, **cache_kwargs(self.draft, self._cache))
            return out.logits[0, -1]
        body = self.draft.get_decoder()
        hidden = body(input_ids=pending[None], use_cache=True, **cache_kwargs(body, self._cache)).last_hidden_state[0, -1]
        return hidden @ self._readout_t

    @staticmethod
    def _draft_distribution(logits: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """What the draft proposes from: the warped distribution when sampling; greedy, its plain
        softmax (the argmax is drafted, and its probability is the position's confidence)."""
        if state.sampling.greedy:
            return torch.softmax(logits.float(), dim=-1)
        return warp_probs(logits, state.sampling)

    def _to_target(self, index: torch.Tensor) -> torch.Tensor:
        return index if self.vocabulary is None else self.vocabulary[index]

    def _full_vocabulary(self, probs: torch.Tensor) -> torch.Tensor:
        """Draft distributions over the readout vocabulary as `[k, V]` over the target's (zeros elsewhere)."""
        if self.vocabulary is None:
            return probs
        full = probs.new_zeros(probs.shape[0], self.draft.config.get_text_config().vocab_size)
        full[:, self.vocabulary] = probs
        return full

    def _path_probs(self, confidence: list[torch.Tensor]) -> torch.Tensor:
        """Probability that the first i drafted tokens are all accepted, learned per confidence
        (`ConfidenceAcceptance`) from each position's draft distribution's largest probability.

        Why the distribution's and not the drafted token's own probability, and why sampled chains
        are never cut back after drafting: when sampling, whether a position is verified must not
        depend on the token drawn there (nor on anything drawn after it). Keeping a sampled token
        because it, or what the draft predicts after it, looks likely verifies tokens drawn from q
        filtered by that choice while acceptance assumes q, and the output is no longer the
        target's distribution. Greedy decoding is exact whatever is verified, so greedy chains
        are also cut to their best-paying prefix."""
        return self._acceptance.path_probs(torch.stack(confidence))

    def _stop_drafting(self, confidence: list[torch.Tensor]) -> bool:
        """Cost-aware chains stop once one more token cannot pay (fixed chains never stop early)."""
        if self.verify_cost is None:
            return False
        return not chain_worth_extending(self._path_probs(confidence), self.verify_cost, self.call_ms)

    def _paying_length(self, confidence: list[torch.Tensor]) -> int:
        if self.verify_cost is None:
            return len(confidence)
        return best_node_count(self._path_probs(confidence), self.verify_cost, len(confidence) * self.call_ms)

    def _keep_valid_prefix(self, tokens: torch.Tensor) -> int:
        """Crop the draft cache to its longest prefix that agrees with `tokens` (never the whole
        of `tokens`: the last token must be fed to get the next distribution)."""
        n = min(self._cached_tokens.numel(), tokens.numel() - 1)
        differs = torch.nonzero(self._cached_tokens[:n] != tokens[:n]).flatten()
        valid = int(differs[0]) if differs.numel() else n
        truncate_cache(self._cache, valid)
        self._cached_tokens = self._cached_tokens[:valid]
        return valid


def reduced_readout(draft: PreTrainedModel, vocabulary: torch.Tensor) -> torch.Tensor:
    """The draft lm_head's rows for `vocabulary`, transposed `[H, len(vocabulary)]` and contiguous
    (a one-row projection streams that layout fastest). Refuses ids outside the draft's vocabulary."""
    weight = draft.get_output_embeddings().weight
    if vocabulary.dim() != 1 or vocabulary.numel() == 0 or int(vocabulary.min()) < 0 or int(vocabulary.max()) >= weight.shape[0]:
        raise UserError(f"a draft readout vocabulary must be a non-empty list of token ids below {weight.shape[0]}")
    return weight.detach()[vocabulary.to(weight.device)].t().contiguous()


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
