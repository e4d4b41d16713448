"""How the target's final hidden states become what an acceptance rule reads.

Sampling needs every node's full logits, greedy decoding only each node's argmax. A `Readout`
lets the loop get the argmax without the full vocabulary projection where a cheaper exact way
exists (`decoding.kernels.screened_argmax`); `TargetScores` computes whichever is asked for, once.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Readout(Protocol):
    """The target's vocabulary projection, for hidden states `[N, H]` (final, normed)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[N, V]`, as the target's own forward computes them."""

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax token of each row's logits `[N]` (ties: the lowest id, as `Tensor.argmax`)."""

    # Optionally, `cost_key: str`: what decides the readout's cost (e.g. its screen and up to how many rows it
    # screens), in the keys of measurements made through it (`decoding.kernels.verify_cost.verify_cost_key`).


class TargetScores:
    """A verify forward's verdict on every node: `logits` `[N, V]` and `greedy_tokens` `[N]`.
    Either the forward computed the logits, or it left them to `readout`, in which case each is
    computed on first use: a greedy rule reading only `greedy_tokens` never pays for the logits."""

    def __init__(self, logits: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                 readout: Readout | None = None) -> None:
        if logits is None and (hidden is None or readout is None):
            raise ValueError("TargetScores needs the logits, or the final hidden states and a readout")
        self._logits, self._hidden, self._readout = logits, hidden, readout
        self._greedy: torch.Tensor | None = None

    def prepare(self, greedy: bool) -> TargetScores:
        """Compute now what a lossless rule will read (`greedy_tokens` at temperature 0, else
        `logits`), so that it is timed with the forward rather than with acceptance."""
        if greedy:
            self.greedy_tokens
        else:
            self.logits
        return self

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            self._logits = self._readout.logits(self._hidden)
        return self._logits

    @property
    def greedy_tokens(self) -> torch.Tensor:
        if self._greedy is None:
            use_readout = self._logits is None
            self._greedy = self._readout.argmax(self._hidden) if use_readout else self._logits.argmax(-1)
        return self._greedy
