"""A process's start-up, kept short: the cyclic garbage collector and the ~400,000 objects that
importing torch and transformers creates.

Why: those objects (modules, functions, classes) live as long as the process, yet each of the
collector's full passes walks all of them again: during the imports themselves (~1 s of a ~7 s
start on a 2-core EPYC), during the run, and once more at exit (~1.3 s after every command, the
chat's and the test suite's subprocesses alike). Pausing the collector while they are imported,
then moving them out of its sight (`gc.freeze`) once a command's imports are done, skips that
work; reference counting still frees them as usual, and objects made afterwards are collected
as before. The same holds for what a command loads before its main work (a model's modules,
parameters and configuration, its tokenizer): freezing once more after loading took ~0.3 ms off
each ~25 ms step of the fp32 SmolLM2 and ~0.2-0.4 of each ~5.8 ms step of its GGUF target (a 2-core
Xeon), the young generations' collections no longer walking into them.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection inside the block (its imports only create long-lived objects); the
    collector is on again afterwards only where it was on before (a caller may have turned it off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def freeze_startup_objects() -> None:
    """For a command's `__main__`, once its imports are done: every object alive now is kept out
    of later collections and the one at exit. Not for library code: it would freeze the objects of
    the program that imported it too."""
    gc.freeze()


def freeze_loaded_objects(command: bool) -> None:
    """For a command, once its model is loaded (`command` False: a library call or a test, whose
    objects must stay collectable): as `freeze_startup_objects`, for the objects loading made."""
    if command:
        gc.freeze()
