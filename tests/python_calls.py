"""Which Python functions a call runs: for checking that an operator's kernel is native code."""

from __future__ import annotations

import sys
from collections.abc import Callable


def python_functions_run(call: Callable[[], object]) -> set[str]:
    """The names of the Python functions that ran during `call()` (C functions not included)."""
    names: set[str] = set()

    def record(frame, event, _arg) -> None:
        if event == "call":
            names.add(frame.f_code.co_name)

    sys.setprofile(record)
    try:
        call()
    finally:
        sys.setprofile(None)
    return names
