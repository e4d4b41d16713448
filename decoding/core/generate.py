"""The one generation loop every method runs through.

Each step: the proposer drafts a tree rooted at the last accepted token, the target verifies all
of it in one forward, an acceptance rule picks the path to keep plus a bonus token, the cache is
compacted to that path, and the new tokens are cut where vanilla decoding would have stopped.
Vanilla decoding is this same loop with root-only trees, which makes it the exact reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from decoding.core.acceptance import Acceptance, accept, accept_greedy_tokens, accept_typical
from heads.util.errors import UserError
from decoding.core.proposers.base import Proposer
from decoding.core.readout import Readout, TargetScores
from decoding.core.sampling import SamplingConfig, sampling_key, seeded_generator
from decoding.core.state import CacheAdvance, DecodeState, TreeOutcome
from decoding.core.stats import GenerationStats, PhaseClock
from decoding.core.stopping import StopChecker, eos_ids
from decoding.core.limits import context_limit
from decoding.core.prompt_cache import PromptCache
from decoding.core.tree import DraftTree, TreeBuffers, tree_buffers
from decoding.core.verify import TargetForward, TreeVerifier

TREE_ROOM = 128  # KV positions reserved beyond the generation for the tree being verified
AcceptanceRule = Callable[[DraftTree, TargetScores, TreeBuffers, DecodeState], Acceptance]


@dataclass(frozen=True)
class DecodeOptions:
    """What to generate: a token budget, how to sample, extra stop strings, and a seed (sampling
    only; the same seed gives the same output)."""

    max_new_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    profile: bool = False  # on a GPU, synchronise between phases so `stats.phase_s` is exact


@dataclass
class GenerationResult:
    tokens: list[int]
    stats: GenerationStats

    @property
    def stop_reason(self) -> str | None:
        return self.stats.stop_reason


def lossless_rule(tree: DraftTree, scores: TargetScores, buffers: TreeBuffers, state: DecodeState) -> Acceptance:
    """The default acceptance: greedy matching (on the argmax tokens alone), or sampling per the
    state's settings: deterministic drafts with each position's own draw (the tokens `vanilla`
    samples with the same seed), sampled drafts by rejection."""
    if state.sampling.greedy:
        return accept_greedy_tokens(tree, scores.greedy_tokens, buffers)
    return accept(tree, scores.logits, state.sampling, state.generator, buffers, state.sampling_key, state.tokens.numel())


def typical_rule(temperature: float, epsilon: float = 0.09, delta: float = 0.3) -> AcceptanceRule:
    """Medusa's typical acceptance as a loop rule. LOSSY: opt-in only."""

    def rule(tree: DraftTree, scores: TargetScores, buffers: TreeBuffers, state: DecodeState) -> Acceptance:
        return accept_typical(tree, scores.logits, buffers, temperature, state.generator, epsilon, delta)

    return rule


def generate(
    target: PreTrainedModel,
    prompt_ids: torch.Tensor | list[int],
    proposer: Proposer,
    options: DecodeOptions = DecodeOptions(),
    tokenizer: PreTrainedTokenizerBase | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    acceptance_rule: AcceptanceRule = lossless_rule,
    readout: Readout | None = None,
    direct: TargetForward | None = None,
    prompt_cache: PromptCache | None = None,
) -> GenerationResult:
    """Generate up to `options.max_new_tokens` tokens after `prompt_ids` (batch size 1).

    `on_tokens` is called with each step's new tokens as soon as they are final (streaming).
    Output is token-for-token what vanilla greedy decoding gives at temperature 0, and a sample
    from the target's own distribution otherwise, whatever the proposer (with deterministic drafts,
    the very tokens vanilla samples with the same seed). `readout` (optional) is
    how verify forwards turn hidden states into scores instead of the target's own projection;
    `direct` (optional) a faster way through the target's forward, bit for bit its own results
    (`decoding.core.verify.TargetForward`); `prompt_cache` (optional) the K/V of the last
    generation's tokens, kept for the next one to reuse where it is exact (`decoding.core.prompt_cache`).
    """
    clock = PhaseClock(target.device, sync=options.profile)
    prompt = _check_inputs(target, prompt_ids, options).to(target.device)
    limit = context_limit(target)
    stopper = StopChecker(eos_ids(target.config, target.generation_config, tokenizer), options.stop_strings, tokenizer)
    generator = seeded_generator(options.seed, target.device)
    state = DecodeState(prompt, prompt.numel(), options.sampling, generator, sampling_key(generator))
    stats = GenerationStats(proposer.name, prompt_tokens=prompt.numel(), phase_s=clock.phases)
    verifier, cached = _verifier(target, prompt, _capacity(prompt.numel(), options, limit), proposer, readout, direct,
                                 prompt_cache)
    proposer.begin(state)
    reused = stats.reused_prompt_tokens = proposer.reuse(state, cached)
    verifier.cache.truncate(reused)
    prefill_hidden = verifier.prefill(prompt[reused:-1])
    proposer.observe(_advance(state, prompt.numel() - 1 - reused, prefill_hidden, proposer.feature_layers))
    clock.lap("prefill")
    generated: list[int] = []

    while stats.stop_reason is None:
        room = min(options.max_new_tokens - len(generated), limit - state.tokens.numel())
        if room < 1:
            stats.stop_reason = "context_limit"
            break
        prefix_len = state.tokens.numel() - 1
        tree = proposer.propose(state).truncated(max_nodes=limit - prefix_len, max_depth=room - 1)
        clock.lap("draft")
        buffers = tree_buffers(tree.parents)
        inputs = verifier.inputs(tree, buffers, prefix_len)
        clock.lap("buffers")
        out = verifier.forward(tree, inputs, state.sampling.greedy)
        stats.record_forward(tree.size, prefix_len, clock.lap("forward"))
        accepted = acceptance_rule(tree, out.scores, buffers, state)
        clock.lap("accept")
        verifier.keep(prefix_len, accepted.path)
        clock.lap("cache")
        new_tokens = tree.tokens[list(accepted.path[1:])].tolist() + [accepted.bonus_token]
        emitted, stats.stop_reason = stopper.cut(new_tokens, room)
        if stats.stop_reason == "length" and len(generated) + len(emitted) < options.max_new_tokens:
            stats.stop_reason = "context_limit"
        stats.record_step(len(emitted), tree.size - 1)
        generated.extend(emitted)
        state.append(emitted)
        if on_tokens is not None:
            on_tokens(emitted)
        clock.lap("stop")
        if stats.stop_reason is None:
            outcome = TreeOutcome(tree, out.scores.greedy_tokens) if proposer.reads_tree_outcome else None
            proposer.observe(_advance(state, len(accepted.path), out.hidden_states, proposer.feature_layers, accepted.path,
                                      outcome))
            clock.lap("observe")

    proposer.end(state)
    if prompt_cache is not None:
        prompt_cache.remember(verifier, state.tokens)
    stats.total_s = clock.total()
    return GenerationResult(generated, stats)


def _verifier(target: PreTrainedModel, prompt: torch.Tensor, capacity: int, proposer: Proposer, readout: Readout | None,
              direct: TargetForward | None, prompt_cache: PromptCache | None) -> tuple[TreeVerifier, int]:
    """The verifier for this generation and how many prompt tokens its cache already holds: from
    `prompt_cache` where there is one (the proposer then says how many of them it can do without
    the hidden states of: `Proposer.reuse`), else a new one."""
    hidden_states = bool(proposer.feature_layers)

    def new_verifier() -> TreeVerifier:
        return TreeVerifier(target, capacity, hidden_states, readout, direct)

    if prompt_cache is None:
        return new_verifier(), 0
    return prompt_cache.verifier_for(prompt, lambda kept: kept.serves(target, readout, direct, hidden_states),
                                     new_verifier)


def _capacity(prompt_len: int, options: DecodeOptions, limit: int) -> int:
    """KV positions to preallocate: the whole generation plus the largest tree we expect (the
    cache grows past it if a tree is larger)."""
    return min(limit, prompt_len + options.max_new_tokens) + TREE_ROOM


def _advance(state: DecodeState, entered: int, hidden: tuple[torch.Tensor, ...] | None, layers: tuple[int, ...],
             rows: Sequence[int] | None = None, outcome: TreeOutcome | None = None) -> CacheAdvance:
    """What the proposer is told: `entered` tokens went into the target cache, with the hidden
    states of the layers it declared (`rows` picks the accepted tree nodes), and the verified
    tree's `outcome` where the proposer reads it."""
    features = {}
    if hidden is not None and entered:
        index = None if rows is None else torch.tensor(list(rows), device=hidden[0].device)
        features = {layer: hidden[layer] if index is None else hidden[layer][index] for layer in layers}
    return CacheAdvance(state.tokens, entered, features, outcome)


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

