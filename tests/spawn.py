"""Run a function on R real processes joined in a gloo group (CPU)."""

from __future__ import annotations

import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, R: int, init_file: str, fn, args: tuple) -> None:
    torch.set_num_threads(1)  # R processes share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=R)
    try:
        fn(rank, R, *args)
    except BaseException:
        # The first rank to fail is often a peer whose connection closed: print
        # every rank's own traceback so the root cause shows in the test log.
        print(f"--- rank {rank} of {R} failed ---\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        dist.destroy_process_group()


def spawn_ranks(R: int, fn, *args) -> None:
    """``fn(rank, R, *args)`` on R processes; a failure on any rank raises here."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(R, os.path.join(tmp, "rendezvous"), fn, args), nprocs=R, join=True)
