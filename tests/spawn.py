"""Run a function on R real processes joined in a gloo group (CPU).

The ranks start from a fork server that imported torch and gdn_kcp once per
test session: a spawned process imports them anew, which cost 5 s for two
ranks and 11.5 s for four on the 2-core CI machine (against 0.1 s forked from
the server), about a third of the suite's time.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The server imports these once; each rank forks from it. It starts with the
# first spawn_ranks call, after conftest has set TRITON_INTERPRET, so the
# preloaded triton reads the same environment a spawned rank would.
multiprocessing.set_forkserver_preload(["torch", "gdn_kcp", "spawn"])


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
        mp.start_processes(_entry, args=(R, os.path.join(tmp, "rendezvous"), fn, args), nprocs=R, join=True,
                           start_method="forkserver")
