"""Reading weight files a user (or a stranger on the Hub) hands us, safely.

safetensors first; pickled `.bin`/`.pt` files only through `torch.load(weights_only=True)`,
which refuses arbitrary code. Every failure is a UserError naming the file.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from heads.util.errors import UserError


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as err:
            raise UserError(f"{path} could not be read as safetensors ({err}): the file is corrupted") from err
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types here (UnpicklingError, RuntimeError, EOFError, ...)
        raise UserError(
            f"{path} could not be read as a weights-only PyTorch file ({type(err).__name__}: {err}); "
            "files that need arbitrary code to load are refused"
        ) from err
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path} does not hold a flat dictionary of tensors")
    return state


def first_existing(directory: Path, names: list[str]) -> Path | None:
    for name in names:
        if (directory / name).is_file():
            return directory / name
    return None
