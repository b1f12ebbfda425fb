import os
import sys
from pathlib import Path

import pytest

# CI has no GPU: the Triton programs run on the CPU under Triton's interpreter.
# Set before anything imports triton; a GPU run sets TRITON_INTERPRET=0 itself.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    """Under Triton's interpreter, refuse an interpreter that cannot run the
    programs' loops: triton 3.6's passes int arguments as 1-element numpy
    arrays, which numpy >= 2.4 no longer converts to the ``range()`` bounds
    ("only 0-dimensional arrays can be converted to Python scalars" in every
    program; triton 3.9 runs them)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from interpreter_check import interpreter_runs_loops
    except ImportError:  # no triton: its tests skip themselves
        return
    problem = interpreter_runs_loops()
    if problem:
        raise pytest.UsageError(problem)
