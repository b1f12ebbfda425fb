"""The ```python blocks of a Markdown file, each under the heading it follows
(any level; headings are read outside code fences only, since a python
comment also starts with ``#``): what the tests run of the README and the
docs, and the block the GPU check compiles (``gpu_capture.py``)."""

from __future__ import annotations

import re
from pathlib import Path


def headed_blocks(path: Path) -> list[tuple[str, str]]:
    """``(heading, code)`` of every python block of ``path``, in order."""
    heading, blocks, fence, code = "", [], None, []
    for line in path.read_text().splitlines(keepends=True):
        if fence is None:
            match = re.match(r"^(#{1,6}) (.+)$", line)
            if match:
                heading = match[2].strip()
            elif line.startswith("```"):
                fence, code = line[3:].strip(), []
        elif line.startswith("```"):
            if fence == "python":
                blocks.append((heading, "".join(code)))
            fence = None
        else:
            code.append(line)
    return blocks
