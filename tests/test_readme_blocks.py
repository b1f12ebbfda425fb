"""README.md's code blocks that need no process group and no compile run as
written on a CPU machine: each is executed in a fresh namespace."""

from __future__ import annotations

import re

import pytest
import torch
from readme_tables import README, options_of, table_rows

from gdn_kcp import OptionsKcp


def python_blocks(section: str) -> list[str]:
    """The ```python blocks of the README section under ``## {section}``."""
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"^```python\n(.*?)^```$", text[start : end if end >= 0 else None], re.S | re.M)


def run_block(section: str) -> dict[str, object]:
    (block,) = python_blocks(section)
    namespace: dict[str, object] = {"__name__": "readme_block"}
    exec(compile(block, f"README.md ## {section}", "exec"), namespace)
    return namespace


def test_api_block():
    ns = run_block("API")
    assert ns["o"].shape == (1, 1000, 4, 128) and ns["final_state"].shape == (3, 4, 128, 128)
    assert ns["v"].grad is not None


def test_byte_query_block():
    """The block runs on the CPU; its workspace is the queried size, its
    backward runs, and its options have a row in the call-figure table."""
    ns = run_block("Byte queries")
    ws, layout, o, v = ns["ws"], ns["layout"], ns["o"], ns["v"]
    assert ws.storage.device.type == "cpu" and ws.nbytes == layout.bytes
    assert o.shape == v.shape and o.dtype == torch.bfloat16 and v.grad is not None
    opts = ns["opts"]
    assert isinstance(opts, OptionsKcp)
    assert opts in [options_of(row[0]) for row in table_rows("call-figures")]


@pytest.mark.parametrize("section", ["API", "Byte queries"])
def test_block_found(section):
    assert len(python_blocks(section)) == 1
