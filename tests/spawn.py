"""Run a function on R real processes joined in a gloo group (CPU)."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, R: int, init_file: str, fn, args: tuple) -> None:
    torch.set_num_threads(1)  # R processes share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=R)
    try:
        fn(rank, R, *args)
    finally:
        dist.destroy_process_group()


def spawn_ranks(R: int, fn, *args) -> None:
    """``fn(rank, R, *args)`` on R processes; a failure on any rank raises here."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(R, os.path.join(tmp, "rendezvous"), fn, args), nprocs=R, join=True)
