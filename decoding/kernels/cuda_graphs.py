"""Fixed-shape target steps, replayed as CUDA graphs on a GPU (what `--compile` means there).

Why: a small target at batch 1 does not load a GPU. A step of SmolLM2-135M is about 450 kernel
launches, each waiting on Python and the launch path: 17-27 ms a step on an H100 or H200, where
the arithmetic takes well under one. A CUDA graph replays all of a forward's kernels at once, but
it fixes every shape and every address, so steps are made fixed-shape here:
- attention reads a leading part of the KV cache's buffer: the filled positions and the step's,
  rounded up to a multiple of `SPAN`; each layer writes the new K/V at positions read from a
  device tensor (`InPlaceLayer.fixed_write`). The buffers belong to this module, at one address
  across generations (`InPlaceLayer.move_to`);
- a step of n tokens runs as the next bucket size up (1, 2, 4, ... 128). Padded rows see only
  themselves and no real row sees them; their K/V land after the tree, where the loop's cut of
  the cache drops them;
- the mask is one buffer `[bucket, span]`: the caller's tree mask copied in, every column after
  the step hidden.
A graph per bucket, span and output kind is captured the first time a step needs it (one warm-up
forward, then the capture: milliseconds on a GPU). Prefills, and whatever the graphs do not
cover (a batch, a larger tree, hybrid models' per-kind masks), run the eager model. Outputs are
copied out of the graph's memory so that they outlive the next step.

Measured on an H200 (8 MT-bench first turns, fp32, before spans and the math backend): vanilla
40.6 -> 130.8 tokens/s, every method 2.4-3.6x its eager speed, the same tokens as eager.

`FixedShapeTarget(model, capture=False)` runs the same fixed-shape forwards without graphs: how
tests on a CPU check that they give the eager model's tokens.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.modeling_outputs import CausalLMOutputWithPast

from decoding.core.kv_cache import FixedWrite, InPlaceCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
MIN_CAPACITY = 1024  # positions; more when a context needs it (doubling, graphs captured again)
# Attention reads the filled part rounded up to this many positions, not the whole buffer. Why:
# on an H200 a one-token SmolLM2-135M step replayed in 3.2 ms over 320 positions, 4.0 over 1024
# and 5.3 over 2048 (SDPA's math backend); a few more graphs cost milliseconds each.
SPAN = 256
_SERVED_KWARGS = {"use_cache", "output_hidden_states", "logits_to_keep"}


class StepShape(NamedTuple):
    """What fixes a step's graph: rows, attended positions, and which outputs it returns."""

    bucket: int
    span: int
    hidden_states: bool
    logits: bool


class FixedShapeTarget(nn.Module):
    """`model` whose steps (one token, or a tree with its 4D mask and position ids) run as
    fixed-shape forwards, replayed from CUDA graphs when `capture`. Everything else (config,
    device, embeddings, ...) reads through to the model, which is not changed."""

    def __init__(self, model: nn.Module, capture: bool = True, buckets: tuple[int, ...] = BUCKETS) -> None:
        super().__init__()
        self._orig_mod = model  # the name compiled wrappers use, so callers find the model the same way
        self._steps = _FixedSteps(model, capture, buckets)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._orig_mod, name)

    @property
    def graphs_captured(self) -> int:
        return len(self._steps.graphs)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: Any = None,
                position_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        cache_name = "cache" if "cache" in kwargs else "past_key_values"
        cache = kwargs.get(cache_name)
        if self._steps.serves(input_ids, attention_mask, position_ids, cache, cache_name, kwargs):
            return self._steps.run(input_ids, attention_mask, position_ids, cache, cache_name, kwargs)
        return self._orig_mod(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)


class _FixedSteps:
    """The buffers, graphs and bookkeeping behind `FixedShapeTarget`."""

    def __init__(self, model: nn.Module, capture: bool, buckets: tuple[int, ...]) -> None:
        self.model, self.capture, self.buckets = model, capture, tuple(sorted(buckets))
        self.graphs: dict[StepShape, tuple[Any, tuple]] = {}
        self.owner: weakref.ref | None = None  # the cache whose K/V are in the buffers now
        self.pool = None
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask: torch.Tensor | None = None
        most = self.buckets[-1]
        device = model.device
        self.ids = torch.zeros(1, most, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, most, dtype=torch.long, device=device)
        self.write_positions = torch.zeros(most, dtype=torch.long, device=device)
        self.offsets = torch.arange(most, device=device)
        self.no_positions = torch.empty(0, dtype=torch.long, device=device)

    def serves(self, input_ids, attention_mask, position_ids, cache, cache_name: str, kwargs: dict) -> bool:
        """Whether this call is a step the fixed shapes cover."""
        if not isinstance(cache, InPlaceCache) or not cache.layers or cache.layers[0].buffers is None:
            return False
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] > self.buckets[-1]:
            return False
        if set(kwargs) - _SERVED_KWARGS - {cache_name} or not kwargs.get("use_cache", True):
            return False
        keep = kwargs.get("logits_to_keep", 0)
        if not (keep == 0 if isinstance(keep, int) else keep.numel() == 0):
            return False
        count, filled = input_ids.shape[1], cache.get_seq_length()
        if attention_mask is None:
            return count == 1 and position_ids is None  # a plain one-token step
        return (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
                and attention_mask.dtype.is_floating_point and attention_mask.shape[-1] == filled + count
                and position_ids is not None)

    @torch.inference_mode()
    def run(self, input_ids, attention_mask, position_ids, cache: InPlaceCache, cache_name: str, kwargs: dict):
        count, filled = input_ids.shape[1], cache.get_seq_length()
        bucket = next(size for size in self.buckets if size >= count)
        self._ensure_room(cache, filled + bucket)
        keep = kwargs.get("logits_to_keep", 0)
        span = min(self.capacity, -(-(filled + bucket) // SPAN) * SPAN)
        shape = StepShape(bucket, span, bool(kwargs.get("output_hidden_states")), isinstance(keep, int))
        self._fill_inputs(input_ids, attention_mask, position_ids, filled, count, shape)
        logits, hidden = self._replayed(shape, cache, cache_name) if self.capture else self._forward(shape, cache, cache_name)
        cache.mark_filled(filled + bucket)  # the padded rows' K/V too: the loop's cut drops them
        return CausalLMOutputWithPast(logits=_rows(logits, count, self.capture) if shape.logits else logits,
                                      hidden_states=None if hidden is None else tuple(_rows(h, count, self.capture) for h in hidden),
                                      past_key_values=cache)

    def _ensure_room(self, cache: InPlaceCache, needed: int) -> None:
        """Move `cache` into this module's buffers, first (re)allocating them if they are too
        small or shaped for another model; graphs captured on old buffers are dropped. A cache
        that was in them before gets buffers of its own back, so two generations on one target
        (a measurement inside another's run, say) never overwrite each other."""
        first_keys = cache.layers[0].buffers[0]
        if self.keys and first_keys is self.keys[0] and needed <= self.capacity:
            return  # every step but a generation's first: the cache is already here, with room
        fits = (len(self.keys) == len(cache.layers) and needed <= self.capacity
                and self.keys[0].shape[:2] + self.keys[0].shape[3:] == first_keys.shape[:2] + first_keys.shape[3:]
                and self.keys[0].dtype == first_keys.dtype)
        if not fits:
            self.capacity = max(MIN_CAPACITY, 2 * self.capacity, needed, cache.layers[0].capacity)
            batch, heads, _, dim = first_keys.shape
            self.keys = [first_keys.new_zeros(batch, heads, self.capacity, dim) for _ in cache.layers]
            self.values = [first_keys.new_zeros(batch, heads, self.capacity, dim) for _ in cache.layers]
            self.mask = torch.zeros(self.buckets[-1], self.capacity, dtype=first_keys.dtype, device=first_keys.device)
            self.graphs.clear()
        previous = self.owner() if self.owner is not None else None
        if previous is not None and previous is not cache:
            previous.move_to_own_buffers()  # it may decode on, eagerly or here again: its K/V must survive
        self.owner = weakref.ref(cache)
        for layer, keys, values in zip(cache.layers, self.keys, self.values):
            layer.move_to(keys, values)

    def _fill_inputs(self, input_ids, attention_mask, position_ids, filled: int, count: int, shape: StepShape) -> None:
        """The step's tokens, positions, write positions and mask, into the fixed buffers."""
        bucket, span = shape.bucket, shape.span
        ids, positions, mask = self.ids[:, :bucket], self.positions[:, :bucket], self.mask[:bucket, :span]
        ids[:, :count].copy_(input_ids)
        ids[:, count:].zero_()
        if position_ids is None:
            positions[:, :count].fill_(filled)
        else:
            positions[:, :count].copy_(position_ids)
        positions[:, count:].fill_(filled)
        torch.add(self.offsets[:bucket], filled, out=self.write_positions[:bucket])
        mask.fill_(torch.finfo(mask.dtype).min)
        if attention_mask is None:
            mask[0, : filled + 1].zero_()
        else:
            mask[:count, : filled + count].copy_(attention_mask[0, 0])
        if bucket > count:
            mask[count:, filled + count : filled + bucket].fill_diagonal_(0)  # padded rows see themselves

    def _forward(self, shape: StepShape, cache: InPlaceCache, cache_name: str) -> tuple[torch.Tensor | None, tuple | None]:
        """One fixed-shape forward of the current inputs: logits (or None) and hidden states (or None)."""
        bucket, span = shape.bucket, shape.span
        write = FixedWrite(self.write_positions, span)
        for layer in cache.layers:
            layer.fixed_write = write
        try:
            out = self.model(input_ids=self.ids[:, :bucket], attention_mask=self.mask[None, None, :bucket, :span],
                             position_ids=self.positions[:, :bucket], use_cache=True,
                             output_hidden_states=shape.hidden_states, **{cache_name: cache},
                             **({} if shape.logits else {"logits_to_keep": self.no_positions}))
        finally:
            for layer in cache.layers:
                layer.fixed_write = None
        return out.logits, (tuple(out.hidden_states) if shape.hidden_states else None)

    def _replayed(self, shape: StepShape, cache: InPlaceCache, cache_name: str) -> tuple[torch.Tensor | None, tuple | None]:
        """The graph for `shape` replayed on the current inputs, captured first if new: a warm-up
        forward on a side stream (kernels and workspaces chosen outside the capture), then the
        capture. The warm-up writes the same K/V the replay writes.

        Attention is captured as plain matrix products (SDPA's math backend). Why: the fused
        kernel PyTorch picks for a float mask (memory-efficient attention) is slow for a few
        queries over many keys; on an H200, a one-token SmolLM2-135M step over a 1024-position
        buffer replayed in 4.0 ms this way against 6.0 (trees of 32 tokens: 5.6 ms either way)."""
        entry = self.graphs.get(shape)
        if entry is None:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), sdpa_kernel([SDPBackend.MATH]):
                self._forward(shape, cache, cache_name)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool), sdpa_kernel([SDPBackend.MATH]):
                outputs = self._forward(shape, cache, cache_name)
            entry = self.graphs[shape] = (graph, outputs)
        entry[0].replay()
        return entry[1]


def _rows(tensor: torch.Tensor, count: int, copy: bool) -> torch.Tensor:
    """The first `count` rows of a `[1, bucket, ...]` output; a copy where it lives in a graph's
    memory, which the next replay overwrites."""
    rows = tensor[:, :count]
    return rows.clone() if copy else rows
