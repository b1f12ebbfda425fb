import os
import sys
from pathlib import Path

import pytest

# CI has no GPU: the Triton programs run on the CPU under Triton's interpreter.
# Set before anything imports triton; a GPU run sets TRITON_INTERPRET=0 itself.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

sys.path.insert(0, str(Path(__file__).parent))

EXTENDED = os.environ.get("GDN_KCP_EXTENDED") == "1"
"""``make test-extended`` (not CI): the cases marked ``extended`` run, those a
CI case already covers in kind (more ranks, the other exchange, another
dtype), kept out of CI to hold ``make test`` under its 20 minutes."""


def pytest_collection_modifyitems(config, items):
    if EXTENDED:
        return
    skip = pytest.mark.skip(reason="extended case: make test-extended (GDN_KCP_EXTENDED=1)")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    """Registers the ``extended`` marker (see :data:`EXTENDED`). Under
    Triton's interpreter, refuse an interpreter that cannot run the
    programs' loops: triton 3.6's passes int arguments as 1-element numpy
    arrays, which numpy >= 2.4 no longer converts to the ``range()`` bounds
    ("only 0-dimensional arrays can be converted to Python scalars" in every
    program; triton 3.9 runs them)."""
    config.addinivalue_line("markers", "extended: a case for make test-extended only (GDN_KCP_EXTENDED=1)")
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from interpreter_check import interpreter_runs_loops
    except ImportError:  # no triton: its tests skip themselves
        return
    problem = interpreter_runs_loops()
    if problem:
        raise pytest.UsageError(problem)
