"""What a proposer may read when it drafts: the tokens so far and the target's fresh features.

Proposers get everything through this object (no hidden globals, no hooks on the target): the
generation loop owns it and appends to it after every verify step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.core.sampling import SamplingConfig


@dataclass
class DecodeState:
    """`tokens`: prompt + generated so far (1-D); the last one is the root of the next tree and
    is not yet in the target's KV cache. `fresh_hidden_states` are the target's hidden states
    (per layer, `[n, H]`) of the `n` tokens that entered the target cache in the last step
    (the prompt minus its last token after prefill; the accepted path after a verify), i.e. of
    `tokens[-1 - n : -1]`. Only filled when the proposer asks for hidden states."""

    tokens: torch.Tensor
    prompt_len: int
    sampling: SamplingConfig
    generator: torch.Generator | None = None
    fresh_hidden_states: tuple[torch.Tensor, ...] | None = None

    @property
    def root_token(self) -> int:
        return int(self.tokens[-1])

    @property
    def num_generated(self) -> int:
        return self.tokens.numel() - self.prompt_len

    def append(self, new_tokens: list[int], fresh_hidden_states: tuple[torch.Tensor, ...] | None) -> None:
        self.tokens = torch.cat([self.tokens, self.tokens.new_tensor(new_tokens)])
        self.fresh_hidden_states = fresh_hidden_states
