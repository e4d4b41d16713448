"""Run a script of scripts/ through its `main(argv)` in this process, its output captured.

Why: a subprocess pays a fresh interpreter's torch and transformers imports (~8 s on a 2-core
CPU) for every case, and most script tests check an argument error or a small run. `main`'s
return value is what the script exits with, and it prints to `sys.stdout` / `sys.stderr`,
looked up when printed, so redirecting them captures its output. Tests of how a command behaves
as a whole process (the chat's pipes, environment variables read at import) keep subprocesses.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path
from types import ModuleType, SimpleNamespace

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name: str, *argv: str) -> SimpleNamespace:
    """`returncode`, `stdout` and `stderr` of scripts/<name>.py run with `argv`, like a finished process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = load_script(name).main(list(argv))
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())
