"""The SM count the segment plan fills (:func:`gdn_kcp.plan.plan_segments`):
the device's, or the CPU's cores; every rank must agree on it."""

from __future__ import annotations

import os

import torch


def check_sms(n_sms: object) -> int:
    if isinstance(n_sms, bool) or not isinstance(n_sms, int) or n_sms < 1:
        raise ValueError(f"n_sms must be an int >= 1, got {n_sms!r}")
    return n_sms


@torch.compiler.assume_constant_result
def device_sms(device: torch.device | str) -> int:
    """The SM count of a CUDA device, the cores this process may run on for the
    CPU (a constant to torch.compile: traced code reads it once)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
