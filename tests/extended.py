"""Parameters for ``make test-extended`` (the ``extended`` marker, tests/conftest.py)."""

from __future__ import annotations

import pytest


def extended_at(values, extended) -> list:
    """``values`` as parameters, those in ``extended`` for make test-extended only."""
    return [pytest.param(v, marks=pytest.mark.extended) if v in extended else v for v in values]
