"""Run a function on R real processes joined in a gloo group (CPU).

The ranks start from a fork server that imported torch and gdn_kcp once per
test session: a spawned process imports them anew, which cost 5 s for two
ranks and 11.5 s for four on the 2-core CI machine (against 0.1 s forked from
the server), about a third of the suite's time.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator

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


def _held_counts(tensors) -> list[tuple[torch.Tensor, int]]:
    """Each tensor with the references to it now (its own, and its views')."""
    return [(t, t._use_count()) for t in tensors]


def _await_release(counts, call: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(t._use_count() > n for t, n in counts):
        if time.monotonic() > deadline:
            raise AssertionError(f"gloo still holds the tensors of {call} {timeout_s} s after it finished")
        time.sleep(1e-4)


class _ReleasedWork:
    """A Work whose ``wait`` returns once gloo has let go of its tensors."""

    def __init__(self, work, counts, call: str) -> None:
        self.work, self.counts, self.call = work, counts, call

    def wait(self) -> bool:
        done, self.work = self.work.wait(), None  # the Work holds the tensors itself
        _await_release(self.counts, self.call)
        self.counts = None
        return done


@contextlib.contextmanager
def gloo_releases_tensors() -> Iterator[None]:
    """Within the block, an all-to-all returns (or its Work's ``wait`` does),
    and so does the wait of a ``batch_isend_irecv`` hop, only once gloo has
    dropped its own references to the tensors it was given.

    Why: gloo's worker thread marks a collective done, which wakes the caller,
    and drops the collective's tensors a moment later. Here a quarter of
    3,000 synchronous all-to-alls with split sizes still held both tensors
    when the call returned; in one CI run the forward's workspace (a view of
    it was sent) so outlived the forward into the backward's peak, 66 KB
    above the program's. A memory trace of a real run waits for the release,
    so it measures what the program holds, not when gloo's thread next runs."""
    a2a, batch = dist.all_to_all_single, dist.batch_isend_irecv

    def all_to_all_single(output, input, *args, **kwargs):
        counts = _held_counts([output, input])
        work = a2a(output, input, *args, **kwargs)
        if work is not None:
            return _ReleasedWork(work, counts, "all_to_all_single")
        _await_release(counts, "all_to_all_single")
        return None

    def batch_isend_irecv(ops):
        counts = _held_counts([op.tensor for op in ops])
        works = batch(ops)
        assert len(works) == len(ops), "gloo returns a Work per hop (it does not coalesce)"
        return [_ReleasedWork(w, [c], "batch_isend_irecv") for w, c in zip(works, counts)]

    dist.all_to_all_single, dist.batch_isend_irecv = all_to_all_single, batch_isend_irecv
    try:
        yield
    finally:
        dist.all_to_all_single, dist.batch_isend_irecv = a2a, batch
