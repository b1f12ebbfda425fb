"""The ```python blocks of README.md and docs/*.md, each under the heading it
follows (any level; headings are read outside code fences only, since a
python comment also starts with ``#``)."""

from __future__ import annotations

import sys
import types

from doc_tables import DOC_FILES, ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from markdown_blocks import headed_blocks  # noqa: E402 (one parser for the tests and the GPU check)


def python_blocks(file: str, heading: str) -> list[str]:
    """The python blocks under ``heading`` in ``file`` (relative to the repository root)."""
    return [code for found, code in headed_blocks(ROOT / file) if found == heading]


def every_block() -> dict[tuple[str, str], int]:
    """How many python blocks each ``(file, heading)`` of README.md and docs/*.md holds."""
    counts: dict[tuple[str, str], int] = {}
    for path in DOC_FILES:
        for heading, _ in headed_blocks(path):
            key = (str(path.relative_to(ROOT)), heading)
            counts[key] = counts.get(key, 0) + 1
    return counts


def block_namespace() -> dict[str, object]:
    """A fresh namespace for blocks, the globals of an importable module
    ``doc_block``: Dynamo in torch 2.11 imports a compiled function's module by
    its ``__name__`` ("No module named 'doc_block'" with a plain dict)."""
    module = types.ModuleType("doc_block")
    sys.modules["doc_block"] = module
    return module.__dict__


def run_block(file: str, heading: str, index: int = 0, namespace: dict | None = None) -> dict[str, object]:
    """Execute one block as a script would run it; returns its namespace
    (:func:`block_namespace` unless one is given)."""
    namespace = block_namespace() if namespace is None else namespace
    code = python_blocks(file, heading)[index]
    exec(compile(code, f"{file} # {heading}, block {index + 1}", "exec"), namespace)
    return namespace
