"""The input dtypes and the compute dtype rule, in one place: fp64 inputs
compute (and keep tapes, states and boundary messages) in fp64, the oracle's
precision; every other input dtype computes in fp32. Every byte query and
``WorkspaceKcp`` reads its ``dtype=`` through :func:`compute_dtype`, so each
refuses a dtype the calls do not take."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The input dtypes of every public function."""


def check_input_dtype(dtype: object, name: str = "dtype") -> torch.dtype:
    """``dtype`` itself when it is one of FLOAT_DTYPES; else ``TypeError`` (not a
    ``torch.dtype``) or ``ValueError`` (another dtype) naming ``name`` and the value."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, one of float16, bfloat16, float32, float64; "
                        f"got {type(dtype).__name__} {dtype!r}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be one of float16, bfloat16, float32, float64 (the input dtype), got {dtype}")
    return dtype


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The compute dtype of inputs of ``dtype`` (checked by :func:`check_input_dtype`)."""
    return torch.float64 if check_input_dtype(dtype) == torch.float64 else torch.float32


def compute_element_size(dtype: torch.dtype) -> int:
    """Bytes of one compute-dtype element for inputs of ``dtype``."""
    return 8 if compute_dtype(dtype) == torch.float64 else 4
