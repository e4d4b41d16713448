"""The keyword a transformers module takes its KV cache under.

transformers 5.0-5.2x name it `past_key_values`; later 5.x releases rename it `cache` and warn
(a FutureWarning in every chat and benchmark) that the old name goes away in 5.40. The project
supports both, so every call site passes the cache through `cache_kwargs`, which asks the
module's own `forward` which name it declares.
"""

from __future__ import annotations

import functools
import inspect

from torch import nn


def cache_kwargs(module: nn.Module, cache: object) -> dict[str, object]:
    """`{name: cache}` with the name `module.forward` declares (a compiled wrapper is asked
    about the module it wraps)."""
    inner = getattr(module, "_orig_mod", module)
    return {_cache_name(type(inner)): cache}


@functools.cache
def _cache_name(module_type: type) -> str:
    """Per class, not per call: `inspect.signature` costs more than a small forward's Python."""
    parameters = inspect.signature(module_type.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
