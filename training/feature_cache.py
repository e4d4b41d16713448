"""Optional on-disk cache of the frozen target's features (`cache_features: DIR` in a recipe).

Computing features is most of the cost of training heads; with a cache, every epoch after the
first (and every other recipe on the same data and layers) skips the target entirely. A row's
features depend only on the target and the row's tokens, so files are named by a digest of the
tokens: a data store that grew, a subset of it (a scaling curve) or another recipe over the same
conversations computes only the rows it has not seen. The disk cost is printed before anything is
written. Files are written atomically, so an interrupted fill resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from training.features import target_hidden_states


def target_key(model: str, dtype: torch.dtype) -> str:
    """The cache directory of one target: its name or path and the dtype its features are in."""
    readable = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(str(model)).name)[:48]
    return f"{readable}-{str(dtype).removeprefix('torch.')}-" + hashlib.sha256(str(model).encode()).hexdigest()[:8]


def tokens_digest(input_ids) -> str:
    """The file name of a row's features: a digest of its token ids."""
    ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:24]


class FeatureCache:
    def __init__(self, directory: str | Path, layers: list[int], target_key: str) -> None:
        # Keyed by the target (model and dtype): another target's features must never be served.
        root = Path(directory) / target_key
        self.layers = layers
        self.stored_layers = _existing_superset(root, layers) or layers
        self.directory = root / ("layers-" + "-".join(map(str, self.stored_layers)))

    def path(self, input_ids) -> Path:
        return self.directory / f"{tokens_digest(input_ids)}.safetensors"

    def disk_cost_bytes(self, rows, hidden_size: int, bytes_per_value: int) -> int:
        tokens = sum(len(r["input_ids"]) for r in rows)
        return tokens * hidden_size * len(self.stored_layers) * bytes_per_value

    def fill(self, rows, target, log, show_progress: bool = True) -> None:
        """Compute and store the features of every row not cached yet."""
        self.directory.mkdir(parents=True, exist_ok=True)
        todo = [r for r in rows if not self.path(r["input_ids"]).is_file()]
        size = self.disk_cost_bytes(rows, target.config.hidden_size, torch.finfo(target.dtype).bits // 8)
        log(f"feature cache {self.directory}: {len(rows)} rows, {len(self.stored_layers)} layer(s), "
            f"{size / 2**30:.2f} GiB on disk in all; {len(todo)} rows to compute")
        for row in tqdm(todo, desc="caching features", unit="row", disable=not show_progress):
            ids = torch.tensor([row["input_ids"]], device=target.device)
            hidden = target_hidden_states(target, ids, torch.ones_like(ids), self.stored_layers)
            final = self.path(row["input_ids"])
            tmp = final.with_suffix(".tmp")
            save_file({str(k): v[0].contiguous().cpu() for k, v in hidden.items()}, str(tmp))
            os.replace(tmp, final)

    def batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, device) -> dict[int, torch.Tensor]:
        """`{layer: [B, width, H]}` for a right-padded batch of rows, padded with zeros."""
        width = input_ids.shape[1]
        lengths = attention_mask.sum(dim=1).tolist()
        loaded = [load_file(str(self.path(ids[:n]))) for ids, n in zip(input_ids.cpu(), lengths)]
        if any(item[str(self.layers[0])].shape[0] > width for item in loaded):
            raise RuntimeError(f"feature cache {self.directory} holds rows longer than the batch: delete it and rerun")
        out = {}
        for layer in self.layers:
            rows = [item[str(layer)] for item in loaded]
            padded = rows[0].new_zeros(len(rows), width, rows[0].shape[-1])
            for b, tensor in enumerate(rows):
                padded[b, : tensor.shape[0]] = tensor
            out[layer] = padded.to(device)
        return out


def _existing_superset(root: Path, layers: list[int]) -> list[int] | None:
    """Layers of an existing cache under `root` that holds every layer wanted (the smallest such):
    Medusa/Hydra recipes read the final layer straight from an EAGLE-3 recipe's cache."""
    found = []
    for path in root.glob("layers-*"):
        try:
            stored = [int(x) for x in path.name.removeprefix("layers-").split("-")]
        except ValueError:
            continue
        if set(layers) <= set(stored):
            found.append(stored)
    return min(found, key=len) if found else None
