"""Counts the bytes the exchanges hand to torch.distributed, per collective."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_active = threading.local()


@contextlib.contextmanager
def record_comm_bytes() -> Iterator[dict[str, dict[str, int]]]:
    """Within the block, every collective adds the bytes of the tensors it sends
    and receives: ``{"c1": {"send": .., "recv": ..}, ...}`` (collectives that ran).

    Example::

        with record_comm_bytes() as log:
            gdn_kcp(q, k, v, g, beta, ctx)[0].sum().backward()
        assert log == {name: ... for name in log}
    """
    log: dict[str, dict[str, int]] = {}
    previous = getattr(_active, "log", None)
    _active.log = log
    try:
        yield log
    finally:
        _active.log = previous


def count(collective: str, sent: list[torch.Tensor], received: list[torch.Tensor]) -> None:
    log = getattr(_active, "log", None)
    if log is None:
        return
    entry = log.setdefault(collective, {"send": 0, "recv": 0})
    entry["send"] += sum(t.numel() * t.element_size() for t in sent)
    entry["recv"] += sum(t.numel() * t.element_size() for t in received)
