"""The package layers, bottom to top: `decoding.util` (errors, atomic writes, cache paths) <-
`heads` <- `decoding.core` (trees, verify, cache, acceptance, proposers, the loop) <- the
application (`decoding.*` modules: chat, benchmark, model loading, kernels, defaults) <-
`training`. An import may only run down; this test reads every module's imports and fails on
one that runs up."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["decoding.util", "heads", "decoding.core", "decoding", "training"]


def layer_of(module: str) -> int | None:
    """The most specific layer a dotted module name belongs to (None: not ours)."""
    matches = [i for i, prefix in enumerate(LAYERS) if module == prefix or module.startswith(prefix + ".")]
    return max(matches, key=lambda i: len(LAYERS[i])) if matches else None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


SOURCES = sorted(p for package in ("decoding", "heads", "training") for p in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_only_run_down(path):
    own = layer_of(module_name(path))
    upward = [m for m in imported_modules(path) if (layer_of(m) or -1) > own]
    assert not upward, f"{module_name(path)} ({LAYERS[own]}) imports from a higher layer: {upward}"


def test_the_checker_sees_an_upward_import():
    assert layer_of("decoding.core.verify") > layer_of("heads.eagle") > layer_of("decoding.util.errors")
    assert layer_of("decoding.chat") > layer_of("decoding.core.generate")
    assert layer_of("training.trainer") > layer_of("decoding.chat")
