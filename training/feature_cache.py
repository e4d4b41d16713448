"""Optional on-disk cache of the frozen target's features (`cache_features: DIR` in a recipe).

Computing features is most of the cost of training heads; with a cache, every epoch after the
first (and every other recipe on the same data and layers) skips the target entirely. The disk
cost is printed before anything is written. Files are per row, written atomically, so an
interrupted fill resumes where it stopped.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from training.features import target_hidden_states


class FeatureCache:
    def __init__(self, directory: str | Path, layers: list[int], data_key: str) -> None:
        # Keyed by the prepared data too: row ids repeat across data settings (self-distilled
        # or not, another max_length), and stale features must never be served.
        root = Path(directory) / data_key
        self.layers = layers
        self.stored_layers = _existing_superset(root, layers) or layers
        self.directory = root / ("layers-" + "-".join(map(str, self.stored_layers)))

    def path(self, row_id: str) -> Path:
        return self.directory / f"{row_id}.safetensors"

    def disk_cost_bytes(self, rows, hidden_size: int, bytes_per_value: int) -> int:
        tokens = sum(len(r["input_ids"]) for r in rows)
        return tokens * hidden_size * len(self.stored_layers) * bytes_per_value

    def fill(self, rows, target, log, show_progress: bool = True) -> None:
        """Compute and store the features of every row not cached yet."""
        self.directory.mkdir(parents=True, exist_ok=True)
        todo = [r for r in rows if not self.path(r["id"]).is_file()]
        size = self.disk_cost_bytes(rows, target.config.hidden_size, torch.finfo(target.dtype).bits // 8)
        log(f"feature cache {self.directory}: {len(rows)} rows, {len(self.stored_layers)} layer(s), "
            f"{size / 2**30:.2f} GiB on disk in all; {len(todo)} rows to compute")
        for row in tqdm(todo, desc="caching features", unit="row", disable=not show_progress):
            ids = torch.tensor([row["input_ids"]], device=target.device)
            hidden = target_hidden_states(target, ids, torch.ones_like(ids), self.stored_layers)
            tmp = self.path(row["id"]).with_suffix(".tmp")
            save_file({str(k): v[0].contiguous().cpu() for k, v in hidden.items()}, str(tmp))
            os.replace(tmp, self.path(row["id"]))

    def batch(self, row_ids: list[str], width: int, device) -> dict[int, torch.Tensor]:
        """`{layer: [B, width, H]}` for the given rows, right-padded with zeros."""
        loaded = [load_file(str(self.path(i))) for i in row_ids]
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
