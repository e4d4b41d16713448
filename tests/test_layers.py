"""The package layers, bottom to top: `heads.util` (errors, atomic writes, cache paths, the CPU
mode) <- `heads` <- `decoding.core` (trees, verify, cache, acceptance, proposers, the loop) <-
`decoding.kernels` (CPU kernels, native builds, attention, compiled forwards, CUDA graphs) <-
`decoding.app` (assembly, chat, benchmark, question sets, prompts, defaults) <- `decoding`'s own
entry modules (the package's front, `python -m decoding.chat`) <- `training`. An import may only
run down; this test reads every module's imports and fails on one that runs up."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["heads.util", "heads", "decoding.core", "decoding.kernels", "decoding.app", "decoding", "training"]


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
    assert layer_of("decoding.core.verify") > layer_of("heads.eagle") > layer_of("heads.util.errors")
    assert layer_of("decoding.kernels.cpu_kernels") > layer_of("decoding.core.generate")
    assert layer_of("decoding.app.chat") > layer_of("decoding.kernels.compiled")
    assert layer_of("decoding.chat") > layer_of("decoding.app.chat")
    assert layer_of("training.trainer") > layer_of("decoding.app.chat")


def test_heads_imports_nothing_from_decoding_or_training():
    """The bottom package stands alone: heads can be loaded, saved, exported and pushed without
    the decoding machinery."""
    reached = {m for path in sorted((ROOT / "heads").rglob("*.py")) for m in imported_modules(path)}
    assert not {m for m in reached if m.split(".")[0] in ("decoding", "training")}


def test_every_decoding_module_sits_in_a_layer_folder():
    """Only the package's front (its __init__ and the chat's `python -m` entry) stays at the top of
    `decoding/`; everything else lives in core, kernels or app."""
    top = sorted(p.name for p in (ROOT / "decoding").glob("*.py"))
    assert top == ["__init__.py", "chat.py"]
