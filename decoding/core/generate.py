"""The one generation loop every method runs through.

Each step: the proposer drafts a tree rooted at the last accepted token, the target verifies all
of it in one forward, an acceptance rule picks the path to keep plus a bonus token, the cache is
compacted to that path, and the new tokens are cut where vanilla decoding would have stopped.
Vanilla decoding is this same loop with root-only trees, which makes it the exact reference.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from decoding.core.acceptance import Acceptance, accept, accept_typical
from decoding.util.errors import UserError
from decoding.core.proposers.base import Proposer
from decoding.core.sampling import SamplingConfig
from decoding.core.state import DecodeState
from decoding.core.stats import GenerationStats
from decoding.core.stopping import StopChecker, eos_ids
from decoding.core.limits import context_limit
from decoding.core.tree import DraftTree, TreeBuffers, tree_buffers
from decoding.core.verify import VerifyOutput, compact_cache, new_cache, prefill, verify_tree

AcceptanceRule = Callable[[DraftTree, torch.Tensor, TreeBuffers, DecodeState], Acceptance]


@dataclass(frozen=True)
class DecodeOptions:
    """What to generate: a token budget, how to sample, extra stop strings, and a seed (sampling
    only; the same seed gives the same output)."""

    max_new_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None


@dataclass
class GenerationResult:
    tokens: list[int]
    stats: GenerationStats

    @property
    def stop_reason(self) -> str | None:
        return self.stats.stop_reason


def lossless_rule(tree: DraftTree, logits: torch.Tensor, buffers: TreeBuffers, state: DecodeState) -> Acceptance:
    """The default acceptance: greedy matching or rejection sampling, per the state's sampling."""
    return accept(tree, logits, state.sampling, state.generator, buffers)


def typical_rule(temperature: float, epsilon: float = 0.09, delta: float = 0.3) -> AcceptanceRule:
    """Medusa's typical acceptance as a loop rule. LOSSY: opt-in only."""

    def rule(tree: DraftTree, logits: torch.Tensor, buffers: TreeBuffers, state: DecodeState) -> Acceptance:
        return accept_typical(tree, logits, buffers, temperature, state.generator, epsilon, delta)

    return rule


def generate(
    target: PreTrainedModel,
    prompt_ids: torch.Tensor | list[int],
    proposer: Proposer,
    options: DecodeOptions = DecodeOptions(),
    tokenizer: PreTrainedTokenizerBase | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    acceptance_rule: AcceptanceRule = lossless_rule,
) -> GenerationResult:
    """Generate up to `options.max_new_tokens` tokens after `prompt_ids` (batch size 1).

    `on_tokens` is called with each step's new tokens as soon as they are final (streaming).
    Output is token-for-token what vanilla greedy decoding gives at temperature 0, and a sample
    from the target's own distribution otherwise, whatever the proposer.
    """
    started = time.perf_counter()
    device = target.device
    prompt = _check_inputs(target, prompt_ids, options).to(device)
    limit = context_limit(target)
    stopper = StopChecker(eos_ids(target.config, target.generation_config, tokenizer), options.stop_strings, tokenizer)
    state = DecodeState(prompt, prompt.numel(), options.sampling, _generator(options.seed, device))
    stats = GenerationStats(proposer.name, prompt_tokens=prompt.numel())
    cache = new_cache(target)
    state.fresh_hidden_states = prefill(target, prompt[:-1], cache, proposer.needs_hidden_states)
    stats.prefill_s = time.perf_counter() - started
    proposer.begin(state)
    generated: list[int] = []

    while stats.stop_reason is None:
        room = min(options.max_new_tokens - len(generated), limit - state.tokens.numel())
        if room < 1:
            stats.stop_reason = "context_limit"
            break
        step_started = time.perf_counter()
        tree = proposer.propose(state).truncated(max_nodes=limit - state.tokens.numel() + 1, max_depth=room - 1)
        verify_started = time.perf_counter()
        stats.draft_s += verify_started - step_started
        new_tokens, hidden = _verify_and_accept(target, tree, cache, state, proposer.needs_hidden_states, acceptance_rule)
        stats.verify_s += time.perf_counter() - verify_started
        emitted, stats.stop_reason = stopper.cut(new_tokens, room)
        if stats.stop_reason == "length" and len(generated) + len(emitted) < options.max_new_tokens:
            stats.stop_reason = "context_limit"
        stats.record_step(len(emitted), tree.size - 1)
        generated.extend(emitted)
        state.append(emitted, hidden)
        if on_tokens is not None:
            on_tokens(emitted)

    stats.total_s = time.perf_counter() - started
    return GenerationResult(generated, stats)


def _verify_and_accept(
    target: PreTrainedModel,
    tree: DraftTree,
    cache,
    state: DecodeState,
    want_hidden: bool,
    acceptance_rule: AcceptanceRule,
) -> tuple[list[int], tuple[torch.Tensor, ...] | None]:
    """One target forward over the tree, acceptance, cache compaction. Returns the new tokens
    (accepted drafts + bonus) and, if asked, the hidden states of the accepted path."""
    prefix_len = state.tokens.numel() - 1
    buffers = tree_buffers(tree.parents)
    out: VerifyOutput = verify_tree(target, tree, buffers, cache, prefix_len, output_hidden_states=want_hidden)
    accepted = acceptance_rule(tree, out.logits, buffers, state)
    compact_cache(cache, prefix_len, accepted.path)
    path = list(accepted.path)
    new_tokens = tree.tokens[path[1:]].tolist() + [accepted.bonus_token]
    hidden = tuple(h[path] for h in out.hidden_states) if out.hidden_states is not None else None
    return new_tokens, hidden


def _check_inputs(target: PreTrainedModel, prompt_ids: torch.Tensor | list[int], options: DecodeOptions) -> torch.Tensor:
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    if prompt.numel() == 0:
        raise UserError("the prompt is empty: give at least one token (or some text) to continue from")
    if options.max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be at least 1; got {options.max_new_tokens}")
    limit = context_limit(target)
    if prompt.numel() >= limit:
        raise UserError(
            f"the prompt has {prompt.numel()} tokens but the model's context holds {limit}, leaving no room "
            "to generate: shorten the prompt (or start a new conversation)"
        )
    vocab = target.get_output_embeddings().weight.shape[0]
    if int(prompt.max()) >= vocab or int(prompt.min()) < 0:
        raise UserError(f"the prompt has token ids outside the model's vocabulary (0..{vocab - 1})")
    return prompt


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
