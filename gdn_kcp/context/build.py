"""build_kcp_context: the public entry. It reads the bounds (or leaves a
device tensor unread for a capped context), resolves the group, checks with
one small all-gather that every rank was given the same split, then calls the
pure builders of :mod:`gdn_kcp.context.builders`."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gdn_kcp.context.builders import capped_context, context_from_split
from gdn_kcp.context.kcp_context import KcpContext
from gdn_kcp.context.sms import check_sms, device_sms
from gdn_kcp.context.split import check_ranges, default_ranges
from gdn_kcp.groups import digest, group_device, resolve_group
from gdn_kcp.validate import (
    check_bounds,
    check_bounds_tensor,
    check_cu_seqlens,
    check_cu_seqlens_traced,
    check_max_docs,
    values_readable,
)


def check_same_everywhere(facts: dict[str, object], group: object, R: int, what: str) -> None:
    """One all_gather of one digest per fact; every rank raises a ``ValueError``
    naming the facts, and the ranks whose values differ from rank 0's."""
    device = group_device(group)
    mine = torch.tensor([digest(value) for value in facts.values()], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(R)]
    dist.all_gather(gathered, mine, group=group)
    every = torch.stack(gathered).cpu()
    for column, name in enumerate(facts):
        differ = [r for r in range(R) if every[r, column] != every[0, column]]
        if differ:
            raise ValueError(f"{what}: ranks {differ} were given a different {name} than rank 0")


_AGREED_CAPS: set[tuple] = set()
"""Caps a group's ranks were found to agree on (ints and names, no tensors):
a capped context per step runs no collective after the first."""


def build_kcp_context(
    cu_seqlens_global: torch.Tensor,
    group: object = None,
    *,
    rank_ranges: list[tuple[int, int]] | None = None,
    device: torch.device | str | None = None,
    max_docs: int | None = None,
    n_sms: int | None = None,
    n_tokens: int | None = None,
) -> KcpContext:
    """Split the packed stream of ``cu_seqlens_global`` (``[N + 1]``, int32/int64,
    or a list of ints; the same on every rank) across the ranks of ``group``:
    None (the default group), a ``ProcessGroup``, a 1-D ``DeviceMesh`` (e.g.
    ``mesh["cp"]``) or a ``(mesh, "cp")`` pair naming the context-parallel
    dimension of a larger mesh (:func:`gdn_kcp.groups.resolve_group`).

    A list needs no read of tensor data, so it also works under FakeTensorMode
    (the index tables are then fake tensors). A tensor whose values the host
    cannot read (a FakeTensor, or one traced by torch.compile) builds a capped
    context with no read at all: it needs ``max_docs`` and the stream's length
    ``n_tokens`` (or ``rank_ranges``, which end at it), and its values are
    checked by device-side asserts. ``n_tokens`` given with readable bounds
    must equal their last value.

    Default split: contiguous and as equal as possible. ``rank_ranges`` gives any
    contiguous split covering ``[0, T)`` (uneven, empty ranks allowed), the same
    on every rank. Without torch.distributed initialised and with ``group=None``
    the context is a single rank. ``device``: where the device copy of the
    metadata lives (default: CUDA for an NCCL group, else CPU).

    ``n_sms``: the streaming multiprocessors the segment plan fills
    (:func:`gdn_kcp.plan.plan_segments`); default: the SM count of ``device``
    when it is a CUDA device, else the CPU's cores. The ranks check that they
    agree on it (it decides P, which must be the same on every rank).

    ``max_docs=N_cap`` builds a *capped* context (docs/design.md, "Capture once"): the stream
    may hold at most ``N_cap`` documents (zero-length ones included; it is
    padded with zero-length documents at T), and every shape and int the calls
    see depends on R, ``rank_ranges`` and ``N_cap`` only, so one compiled
    graph, one CUDA graph and one :class:`~gdn_kcp.WorkspaceKcp` serve every
    packing. Its ranks check once per group and caps, with one small
    collective, that they agree on the caps; an exact context (``max_docs=None``)
    checks ``cu_seqlens_global`` and ``rank_ranges`` on every build.

    Example::

        ctx = build_kcp_context(torch.tensor([0, 700, 1000, 4096]), rank_ranges=[(0, 1000), (1000, 4096)])
        ctx = build_kcp_context(cu_seqlens_of_this_step, max_docs=64)   # training: one layout for every step
    """
    group = resolve_group(group)
    bounds, T = _global_bounds(cu_seqlens_global, max_docs, n_tokens, rank_ranges)
    if dist.is_available() and dist.is_initialized():
        R, rank = dist.get_world_size(group), dist.get_rank(group)
        if rank < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of group={group!r}")
        group_name = (group if group is not None else dist.group.WORLD).group_name
    elif group is None:
        R, rank, group_name = 1, 0, ""
    else:
        raise ValueError(f"group={group!r} was given but torch.distributed is not initialised")
    ranges = default_ranges(T, R) if rank_ranges is None else check_ranges(rank_ranges, T, R)
    if device is None:
        device = group_device(group) if R > 1 else torch.device("cpu")
    n_sms = device_sms(device) if n_sms is None else check_sms(n_sms)
    if R > 1 and torch._guards.detect_fake_mode() is not None:
        pass  # a fake all-gather carries no values: the ranks' agreement is checked by the real run
    elif R > 1 and max_docs is None:
        check_same_everywhere({"cu_seqlens_global": bounds, "rank_ranges": ranges, "n_sms": n_sms}, group, R,
                              "build_kcp_context")
    elif R > 1 and (group_name, tuple(ranges), max_docs, n_sms) not in _AGREED_CAPS:
        check_same_everywhere({"rank_ranges": ranges, "max_docs": max_docs, "n_sms": n_sms}, group, R,
                              "build_kcp_context (capped)")
        _AGREED_CAPS.add((group_name, tuple(ranges), max_docs, n_sms))
    if bounds is None:  # values on the device: pad to the cap with zero-length documents at T, read nothing
        cu = cu_seqlens_global.to(torch.int64)
        padded = torch.cat([cu, cu.new_full((max_docs + 1 - cu.shape[0],), T)])
        return capped_context(padded, ranges, rank, group=group, group_name=group_name, device=device, n_sms=n_sms)
    return context_from_split(bounds, ranges, rank, group=group, group_name=group_name, device=device,
                              max_docs=max_docs, n_sms=n_sms)


def _global_bounds(cu_seqlens_global: object, max_docs: object, n_tokens: object,
                   rank_ranges: object) -> tuple[list[int] | None, int]:
    """``(bounds, T)`` of :func:`build_kcp_context`'s stream, checked; bounds
    None for a tensor whose values the host cannot read (then checked on the
    device against the T of ``n_tokens`` or ``rank_ranges``)."""
    name = "cu_seqlens_global"
    if n_tokens is not None and (isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0):
        raise ValueError(f"n_tokens must be an int >= 0 or None, got {n_tokens!r}")
    if isinstance(cu_seqlens_global, (list, tuple)):
        bounds = check_bounds(name, cu_seqlens_global, n_tokens)
    elif isinstance(cu_seqlens_global, torch.Tensor) and values_readable(cu_seqlens_global):
        bounds = check_cu_seqlens(cu_seqlens_global, n_tokens, name=name)
    elif isinstance(cu_seqlens_global, torch.Tensor):
        check_bounds_tensor(name, cu_seqlens_global)
        if max_docs is None:
            raise ValueError(f"{name} is a fake or traced tensor, whose values cannot be read on the host: pass "
                             f"max_docs= for a capped context (its layout depends on the caps only), or the bounds "
                             f"as a list")
        check_max_docs(max_docs, cu_seqlens_global.shape[0] - 1, name)
        T = n_tokens if n_tokens is not None else _ranges_end(rank_ranges)
        if T is None:
            raise ValueError(f"{name} is a fake or traced tensor, whose values cannot be read on the host: pass "
                             f"n_tokens= (the stream's length T) or rank_ranges=")
        check_cu_seqlens_traced(cu_seqlens_global, T, name=name)
        return None, T
    else:
        raise TypeError(f"{name} must be a torch.Tensor or a list of ints [N + 1], got "
                        f"{type(cu_seqlens_global).__name__}")
    if max_docs is not None:
        check_max_docs(max_docs, len(bounds) - 1, name)
    return bounds, bounds[-1]


def _ranges_end(rank_ranges: object) -> int | None:
    """The end of the last rank range, when ``rank_ranges`` has one to read
    (:func:`check_ranges` checks the rest)."""
    try:
        return int(rank_ranges[-1][1])
    except (TypeError, IndexError, ValueError):
        return None
