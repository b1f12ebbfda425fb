"""The compute dtype rule, in one place: fp64 inputs compute (and keep tapes,
states and boundary messages) in fp64, the oracle's precision; every other
input dtype computes in fp32."""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def compute_element_size(dtype: torch.dtype) -> int:
    """Bytes of one compute-dtype element for inputs of ``dtype``."""
    return 8 if compute_dtype(dtype) == torch.float64 else 4
