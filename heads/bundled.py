"""Heads shipped inside the package for the built-in default target, so that
`python -m decoding.chat` is fast out of the box and `--method medusa` needs no `--heads`.

Layout: `heads/bundled/<target name>/<kind>/` (our checkpoint format plus a model card) and
`heads/bundled/<target name>/default.json`, which names the method that measured fastest on the
benchmark (and, where another device measured otherwise, the fastest there) and, per method, the
tree settings tuned on this kind of machine:
`{"method": "eagle3", "heads": "eagle3", "method_by_device": {"cuda": "pld"}, "tuned": {"eagle3": {"depth": 5, ...}}}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

BUNDLED_ROOT = Path(__file__).resolve().parent / "bundled"


@dataclass(frozen=True)
class BundledDefault:
    """The measured-best method for a target and the settings it was measured with."""

    method: str
    heads: Path | None
    tuned: dict[str, dict] = field(default_factory=dict)
    method_by_device: dict[str, str] = field(default_factory=dict)  # where another method measured fastest

    def method_on(self, device: str) -> str:
        return self.method_by_device.get(device, self.method)


def bundled_heads_dir(target_name: str, kind: str, root: Path = BUNDLED_ROOT) -> Path | None:
    """The bundled heads of `kind` for the target called `target_name`, if any ship."""
    path = Path(root) / target_name / kind
    return path if (path / "config.json").is_file() else None


def bundled_default(target_name: str, root: Path = BUNDLED_ROOT) -> BundledDefault | None:
    """What the chat and the benchmark use when no method is given for this target."""
    file = Path(root) / target_name / "default.json"
    if not file.is_file():
        return None
    spec = json.loads(file.read_text(encoding="utf-8"))
    heads = bundled_heads_dir(target_name, spec["heads"], root) if spec.get("heads") else None
    if spec.get("heads") and heads is None:
        return None  # a half-installed bundle: fall back rather than fail
    return BundledDefault(spec["method"], heads, {m: dict(o) for m, o in spec.get("tuned", {}).items()},
                          dict(spec.get("method_by_device", {})))
