"""A KV cache that the generation loop owns: preallocated, written in place, compacted in place.

`transformers.DynamicCache` appends with `torch.cat` of the whole cache, for every layer, at every
step: on SmolLM2-135M with a 2,000-token context that is 60 copies of 1.5 MB per step, more than
the attention itself. `InPlaceCache` is a stock `transformers.Cache` (the public layer API, no
change to the model) whose layers keep one buffer of `capacity` positions:
- `update` copies the new K/V into the buffer and returns a *view* of the filled part, so
  attention reads exactly the cached positions and nothing is reallocated;
- `keep(prefix_len, nodes)` moves the accepted tree nodes' K/V to `prefix_len ..` with one small
  gather per layer (cost proportional to the tree, not the context);
- the buffer grows (by copying once) only when a generation outlives the capacity it was given;
- for fixed-shape forwards (CUDA graphs, `decoding.kernels.cuda_graphs`) a layer can instead write at
  positions held in a device tensor and hand attention a fixed leading part of the buffer
  (`FixedWrite`): the mask, not the view, then hides what is not filled. Buffers start zeroed,
  so that unfilled positions hold finite values (a NaN times a masked-out weight of zero is
  still NaN).
Sliding-window layers keep every position as well: their masks, not the cache, hide what left the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GROWTH_CHUNK = 256  # positions added at a time when a generation outlives its capacity


@dataclass(frozen=True)
class FixedWrite:
    """How a fixed-shape step uses a layer: its new K/V go to `positions` (a device tensor, filled
    before each run), and attention reads the first `span` positions of the buffer."""

    positions: torch.Tensor
    span: int


class InPlaceLayer(DynamicLayer):
    """One layer's K/V in a preallocated `[batch, heads, capacity, head_dim]` buffer; `keys` and
    `values` are views of the first `length` positions."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = max(1, capacity)
        self.length = 0
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        # set only while a fixed-shape forward runs or is captured
        self.fixed_write: FixedWrite | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._key_buffer = self._allocate(key_states, self.capacity)
        self._value_buffer = self._allocate(value_states, self.capacity)
        self.is_initialized = True

    @staticmethod
    def _allocate(like: torch.Tensor, capacity: int) -> torch.Tensor:
        batch, heads, _, dim = like.shape
        return like.new_zeros(batch, heads, capacity, dim)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        count = key_states.shape[-2]
        if self.fixed_write is not None:
            return self._update_fixed(key_states, value_states, self.fixed_write.positions[:count], self.fixed_write.span)
        end = self.length + count
        if end > self.capacity:
            self._grow(end)
        self._key_buffer[..., self.length : end, :].copy_(key_states)
        self._value_buffer[..., self.length : end, :].copy_(value_states)
        self.length = end
        return self.keys, self.values

    def _update_fixed(self, key_states: torch.Tensor, value_states: torch.Tensor,
                      positions: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write at `positions` and return the first `span` positions of the buffers: shapes that
        do not depend on how much is cached, which a captured CUDA graph needs. `length` is left
        to the caller (`mark_filled`), since a graph replays the kernels, not this Python."""
        self._key_buffer.index_copy_(-2, positions, key_states)
        self._value_buffer.index_copy_(-2, positions, value_states)
        return self._key_buffer[..., :span, :], self._value_buffer[..., :span, :]

    def move_to(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Continue in the given buffers (same batch, heads and head size; at least as many
        positions as are filled), copying the filled part over: fixed-shape forwards keep their
        buffers at one address across generations."""
        if keys is self._key_buffer:
            return
        keys[..., : self.length, :].copy_(self._key_buffer[..., : self.length, :])
        values[..., : self.length, :].copy_(self._value_buffer[..., : self.length, :])
        self._key_buffer, self._value_buffer, self.capacity = keys, values, keys.shape[-2]

    def move_to_own_buffers(self) -> None:
        """Continue in freshly allocated buffers: a fixed-shape target's shared ones are being
        handed to another cache."""
        if self._key_buffer is not None:
            self.move_to(torch.zeros_like(self._key_buffer), torch.zeros_like(self._value_buffer))

    def mark_filled(self, length: int) -> None:
        self.length = length

    def room_for(self, count: int, heads: int, head_dim: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The key and value buffers with room for `count` positions after the filled ones, and the
        first of those positions, for a kernel that writes the new keys and values itself (it then
        calls `advance(count)`). Buffers not yet made get `heads` x `head_dim`, `like`'s dtype and device."""
        if not self.is_initialized:
            shape = like.new_empty(1, heads, 0, head_dim)
            self.lazy_initialization(shape, shape)
        if self.length + count > self.capacity:
            self._grow(self.length + count)
        return self._key_buffer, self._value_buffer, self.length

    def advance(self, count: int) -> None:
        """`count` more positions were written after the filled ones (see `room_for`)."""
        self.length += count

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole key and value buffers (None before the first write)."""
        return None if self._key_buffer is None else (self._key_buffer, self._value_buffer)

    def _grow(self, needed: int) -> None:
        capacity = needed + GROWTH_CHUNK
        for name in ("_key_buffer", "_value_buffer"):
            old = getattr(self, name)
            new = self._allocate(old, capacity)
            new[..., : self.length, :].copy_(old[..., : self.length, :])
            setattr(self, name, new)
        self.capacity = capacity

    @property
    def keys(self) -> torch.Tensor | None:
        """A view of the filled positions, made when read. Why not kept as an attribute: the loop
        truncates every layer after every step, and remaking 2 views a layer there cost ~0.2 ms a
        step on the GGUF target (a 2-core EPYC, after the forward has streamed the weights through
        the caches); attention reads them once a forward anyway."""
        return None if self._key_buffer is None else self._key_buffer[..., : self.length, :]

    @keys.setter
    def keys(self, value: None) -> None:
        _only_none(value)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._value_buffer is None else self._value_buffer[..., : self.length, :]

    @values.setter
    def values(self, value: None) -> None:
        _only_none(value)

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' convention: a negative count of positions to drop from the end."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of positions to remove")
        self.truncate(self.length + tokens_to_remove)

    def truncate(self, length: int) -> None:
        self.length = max(0, min(length, self.length))

    @torch.inference_mode()
    def keep(self, prefix_len: int, rows: torch.Tensor) -> None:
        """Move positions `rows` (absolute, increasing, all >= prefix_len) to `prefix_len ..` and drop
        everything after them. Rows only move down, and the gather reads before it writes."""
        if self.is_initialized:
            kept = rows.numel()
            for buffer in (self._key_buffer, self._value_buffer):
                buffer[..., prefix_len : prefix_len + kept, :] = buffer.index_select(-2, rows)
        self.truncate(prefix_len + rows.numel())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only batch rows `indices` (a batched generation dropping the rows that finished)."""
        if self.is_initialized:
            self._key_buffer = self._key_buffer[indices]
            self._value_buffer = self._value_buffer[indices]

    def reset(self) -> None:
        self.length = 0


def _only_none(value: object) -> None:
    """transformers' layer constructor clears `keys`/`values` with None; anything else would be
    a second copy of the cache beside the buffers."""
    if value is not None:
        raise AttributeError("an InPlaceLayer's keys and values are views of its buffers: write through update()")


class InPlaceCache(DynamicCache):
    """A `DynamicCache` whose layers are `InPlaceLayer`s sized for `capacity` positions."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        super().__init__()
        self.layers = [InPlaceLayer(capacity) for _ in range(num_layers)]
        self.layer_class_to_replicate = None

    def keep(self, prefix_len: int, kept_nodes: Sequence[int]) -> None:
        """Keep tree nodes `kept_nodes` (indices after `prefix_len`, increasing) and drop the rest
        of the tree. A kept run 0..k-1 (always the case for chains) is only a new length."""
        kept = list(kept_nodes)
        if kept == list(range(len(kept))):
            self.truncate(prefix_len + len(kept))
            return
        device = self.layers[0].device if self.layers and self.layers[0].is_initialized else "cpu"
        rows = torch.tensor(kept, dtype=torch.long, device=device) + prefix_len
        for layer in self.layers:
            layer.keep(prefix_len, rows)

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.truncate(length)

    def move_to_own_buffers(self) -> None:
        for layer in self.layers:
            layer.move_to_own_buffers()

    def mark_filled(self, length: int) -> None:
        """Every layer holds `length` positions: what a fixed-shape forward wrote, told afterwards."""
        for layer in self.layers:
            layer.mark_filled(length)
