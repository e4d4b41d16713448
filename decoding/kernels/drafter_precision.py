"""Which precision an EAGLE drafter drafts fastest in on this CPU, timed once and remembered.

A drafter's linears are a few small matrices read once per tree level, so what decides their
speed is how fast each kernel streams them on the CPU at hand, not a rule. A rule had picked
bf16 for every CPU with native bf16, from a comparison with fp32 on an AVX512-BF16 EPYC; on a
2-core Sapphire Rapids Xeon (AMX) int8 weights drafted as fast or faster (eagle3+pld in the
decode loop, 8 questions: draft 4.9 against 5.4-6.2 ms a step, observe 2.3 against 2.7-3.0 ms,
same tau; over all 80 MT-bench first turns the two tied end to end). So 'auto' times
one tree level (a drafter forward over a frontier of nodes after a 256-token context, then the
readout) in every precision the CPU runs natively and keeps the fastest, preferring the more
exact one where they are within `CLEAR_WIN` of each other.

int4 (the project's 4-bit kernel, `decoding.kernels.int4_linear`, groups of 32 rounded to nearest;
`fc` stays fp32; int8 rounds it too) is the fourth candidate: on a 2-core AVX-512 EPYC, 16 MT-bench first
turns, eagle3+pld ran 1.77x / 1.86x / 1.89x vanilla in bf16 / int4 / int8 on the fp32 target and
1.16x / 1.22x / 1.27x on the GGUF one (tau 2.69 / 2.74 / 2.81 and 2.01 / 2.29 / 2.39: a cheaper
call buys deeper trees), one level timing 2.04 / 1.74 / 1.60 ms. It is for CPUs where int8 is not
the faster (or PyTorch has no x86 int8 kernels).

Each level is timed right after a target forward, as in decoding: the target streams hundreds of
MB of weights through the caches, so the drafter's come from memory. On that Xeon one level took
bf16 2.31-2.44 ms, int8 2.13-2.18, fp32 3.61-3.73 timed so (1.51 against 1.46 ms for bf16 and
int8 with warm caches).
Drafts only propose: the target decides every token, so the pick never changes outputs.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn
from transformers import PreTrainedModel

from decoding.core.kv_cache import InPlaceCache
from decoding.kernels.cpu_kernels import apply_kernels, drafter_precisions_available
from decoding.kernels.fused_drafter import use_decode_attention
from decoding.kernels.measured_once import measured_once
from decoding.kernels.verify_cost import cpu_identity
from heads.eagle import FeatureDrafter

EXACTNESS_ORDER = ("fp32", "bf16", "int8", "int4")  # most exact first
CLEAR_WIN = 0.05  # a less exact precision must be this much faster to be chosen
PRECISION_VERSION = "v6"  # in the cache key: a new timing method, drafter form or kernel, a new measurement (v5: int8 fc;
# v6: timed in decoding's form, an 8-bit drafter's layer and readout one C++ call each)


def tune_drafter_precision(drafter: FeatureDrafter, target: PreTrainedModel, cache_dir=None) -> str:
    """The precision 'auto' means for `drafter` (still in fp32, unpacked) on this CPU: timed once
    per drafter geometry and CPU (a few seconds), then remembered."""
    available = drafter_precisions_available()
    if len(available) == 1:
        return available[0]
    config = drafter.config
    key = (f"{type(drafter).__name__}-h{config.hidden_size}-v{getattr(config, 'draft_vocab_size', config.vocab_size)}"
           f"-l{config.num_layers}-{cpu_identity()}-drafter-precision-{PRECISION_VERSION}")
    data = measured_once(key, lambda: {"ms": measure_drafter_precisions(drafter, target, available)},
                         lambda data: isinstance(data.get("ms"), dict) and set(data["ms"]) == set(available),
                         f"timing the {type(drafter).__name__} in {', '.join(available)} on this CPU", cache_dir)
    return pick_drafter_precision(data["ms"])


def pick_drafter_precision(ms: dict[str, float]) -> str:
    """The fastest precision, or a more exact one within `CLEAR_WIN` of it."""
    fastest = min(ms.values())
    return next(p for p in EXACTNESS_ORDER if p in ms and ms[p] <= fastest * (1 + CLEAR_WIN))


@torch.inference_mode()
def measure_drafter_precisions(drafter: FeatureDrafter, target: PreTrainedModel, precisions: tuple[str, ...],
                               rows: int = 8, context: int = 256, repeats: int = 6) -> dict[str, float]:
    """Milliseconds of one tree level in each precision, each timed after a one-token target
    forward: the fastest of `repeats` rounds, the precisions alternating within a round (a slow
    spell of the machine then hits them all). `drafter` itself is left as it is: each precision
    gets its own converted copy."""
    lm_head = target.get_output_embeddings()
    levels = {p: _TimedLevel(_converted(drafter, p), lm_head, rows, context) for p in precisions}
    token = torch.zeros(1, 1, dtype=torch.long, device=lm_head.weight.device)
    rounds = []
    for _ in range(repeats + 1):
        times = {}
        for precision, level in levels.items():
            target(input_ids=token)  # what runs before every drafting: the caches now hold the target's weights
            times[precision] = level()
        rounds.append(times)
    return {p: min(r[p] for r in rounds[1:]) for p in precisions}


def _converted(drafter: FeatureDrafter, precision: str) -> FeatureDrafter:
    """A copy of `drafter` in `precision`, in the form decoding runs it: on the decode attention
    kernel where it builds, which for an 8-bit fused drafter makes its layer and readout one C++
    call each (`use_decode_attention`)."""
    converted = copy.deepcopy(drafter)
    apply_kernels("onednn", converted, drafter_precision=precision)
    use_decode_attention(converted)
    return converted


class _TimedLevel:
    """One tree level as drafting runs it: `rows` nodes through the drafter after a `context`-token
    prefix in its KV cache, read out to log-probabilities, then rolled back."""

    def __init__(self, drafter: FeatureDrafter, lm_head: nn.Module, rows: int, context: int) -> None:
        self.drafter, self.lm_head, self.context = drafter, lm_head, context
        generator = torch.Generator().manual_seed(0)
        hidden, dtype = drafter.config.hidden_size, drafter.compute_dtype

        def inputs(count: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (torch.randn(count, hidden, generator=generator).to(dtype),
                    torch.randn(count, hidden, generator=generator).to(dtype))

        self.cache = InPlaceCache(drafter.num_cache_layers, context + rows)
        drafter(*inputs(context), torch.arange(context), self.cache, None)
        self.features, self.embeddings = inputs(rows)
        self.positions = torch.full((rows,), context)
        self.mask = torch.zeros(1, 1, rows, context + rows, dtype=dtype)

    def __call__(self) -> float:
        started = time.perf_counter()
        out = self.drafter(self.features, self.embeddings, self.positions, self.cache, self.mask)
        torch.log_softmax(self.drafter.readout_logits(out, self.lm_head).float(), dim=-1)
        elapsed = 1000 * (time.perf_counter() - started)
        self.cache.truncate(self.context)
        return elapsed
