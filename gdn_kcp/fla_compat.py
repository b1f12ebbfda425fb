"""flash-linear-attention's call forms of ``chunk_gated_delta_rule`` that are
not math: its deprecated and extra keywords, ``state_v_first`` states, and the
precomputed ``cu_seqlens_cpu`` / ``chunk_indices`` it lets a caller pass.

Precomputed tables are checked against ``cu_seqlens``, never trusted: on the
CPU eagerly (a ``ValueError``), on a GPU or in traced code by device-side
asserts (no host sync; a mismatch fails the step at its next sync).
"""

from __future__ import annotations

import warnings

import torch

from gdn_kcp.kernels.chunk_index import CHUNK_SIZE
from gdn_kcp.validate import INDEX_DTYPES, check_bounds_tensor, check_flag, check_tensor, values_readable


FLA_CHUNK_SIZES = {
    "chunk_gated_delta_rule": ((16, 32, 64), "16, 32, or 64 for Gated Delta Rule"),
    "chunk_kda": ((32, 64), "either 32 or 64 for KDA"),
}
"""The ``chunk_size`` values FLA's chunked entries accept, with the words of
FLA's refusal (its own tests match them with ``pytest.raises(match=...)``)."""


def fla_chunk_size(kwargs: dict, fn: str) -> int:
    """FLA's ``chunk_size`` keyword of ``fn`` (popped from ``kwargs``; default 64).

    Every size FLA accepts is taken, and the programs compute on
    ``CHUNK_SIZE = 64``-token chunks whatever was asked: the chunk form is
    exact at any chunk size, so outputs, states and gradients differ from a
    smaller chunk's only by rounding, and no byte query changes. Where a
    result names chunks (``return_intermediate_states``' states at chunk
    starts) they are the asked size's. Any other value is FLA's
    ``ValueError`` in its wording, naming the value."""
    chunk_size = kwargs.pop("chunk_size", CHUNK_SIZE)
    sizes, words = FLA_CHUNK_SIZES[fn]
    if type(chunk_size) is not int or chunk_size not in sizes:
        raise ValueError(f"`chunk_size` must be {words}, got chunk_size = {chunk_size!r} (the programs compute on "
                         f"{CHUNK_SIZE}-token chunks whichever of {', '.join(map(str, sizes))} is asked)")
    return chunk_size


def fla_keywords(state_v_first: object, kwargs: dict, fn: str = "chunk_gated_delta_rule") -> bool:
    """Check FLA's extra keywords of ``fn``'s ``**kwargs`` and return ``state_v_first``:
    ``transpose_state_layout`` (FLA's deprecated name of ``state_v_first``,
    with FLA's warning and its error when both are given), ``head_first``
    (removed by FLA, which raises ``DeprecationWarning``), ``chunk_size``
    (the chunked entries only: :func:`fla_chunk_size`). FLA ignores any other keyword; here it is a
    ``TypeError``, so a misspelt option is never dropped."""
    check_flag("state_v_first", state_v_first)
    kwargs = dict(kwargs)
    if "head_first" in kwargs:
        raise DeprecationWarning(f"head_first was removed from {fn} (as in flash-linear-attention): "
                                 "pass q, k, v, g, beta as [B, T, H, ...]")
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("pass state_v_first or its deprecated name transpose_state_layout, not both")
        warnings.warn("transpose_state_layout is deprecated: its name is now state_v_first", DeprecationWarning,
                      stacklevel=3)
        state_v_first = kwargs.pop("transpose_state_layout")
        check_flag("transpose_state_layout", state_v_first)
    if fn in FLA_CHUNK_SIZES:
        fla_chunk_size(kwargs, fn)
    unknown = sorted(kwargs)
    if unknown:
        raise TypeError(f"{fn}() got unexpected keyword arguments {unknown}")
    return state_v_first


def states_chunk_size(return_intermediate_states: object, kwargs: dict) -> int | None:
    """The chunk size whose starts ``return_intermediate_states`` asks the
    states of (FLA's ``chunk_size``, already checked by :func:`fla_keywords`),
    or None when it is False; a ``TypeError`` unless it is a bool."""
    check_flag("return_intermediate_states", return_intermediate_states)
    return kwargs.get("chunk_size", CHUNK_SIZE) if return_intermediate_states else None


def check_cp_context(cp_context: object, kcp_entry: str = "gdn_kcp") -> None:
    if cp_context is not None:
        raise ValueError("cp_context (flash-linear-attention's context parallelism) is not taken here: split the "
                         f"stream with gdn_kcp.build_kcp_context and call gdn_kcp.{kcp_entry} on every rank")


def _check_equal(name: str, actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """``actual == expected`` (same shape): a ``ValueError`` when both can be
    read on the host without a sync, a device-side assert otherwise."""
    if actual.shape != expected.shape:
        raise ValueError(f"{name} has shape {tuple(actual.shape)}, {what} has {tuple(expected.shape)}")
    if actual.device.type == "cpu" and values_readable(actual) and values_readable(expected):
        equal = actual.to(expected.device, expected.dtype) == expected
        if not bool(equal.all()):
            first = int((~equal).reshape(equal.shape[0], -1).any(1).nonzero()[0])
            raise ValueError(f"{name} disagrees with {what} from row {first} on: {name}[{first}] = "
                             f"{actual[first].tolist()}, expected {expected[first].tolist()}")
        return
    same = (actual.to(expected.device, expected.dtype, non_blocking=True) == expected).all()
    torch._assert_async(same, f"{name} disagrees with {what}")


def check_cu_seqlens_cpu(cu_seqlens_cpu: object, cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    """``cu_seqlens_cpu``: FLA's host copy of ``cu_seqlens``; returned for the
    host checks (which then read no device tensor), checked to equal it."""
    if cu_seqlens_cpu is None:
        return None
    if cu_seqlens is None:
        raise ValueError("cu_seqlens_cpu was given without cu_seqlens: pass both (the same bounds)")
    check_bounds_tensor("cu_seqlens", cu_seqlens)
    check_bounds_tensor("cu_seqlens_cpu", cu_seqlens_cpu)
    if cu_seqlens_cpu.device.type != "cpu":
        raise ValueError(f"cu_seqlens_cpu must be on the CPU, got {cu_seqlens_cpu.device}")
    # no blocking host-to-device copy: on a GPU it would wait for the stream, the sync this copy exists to avoid
    _check_equal("cu_seqlens_cpu", cu_seqlens_cpu.to(cu_seqlens.device, non_blocking=True), cu_seqlens, "cu_seqlens")
    return cu_seqlens_cpu


def expected_chunk_indices(cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    """FLA's ``chunk_indices`` of ``cu_seqlens`` at ``rows`` rows: per chunk
    of 64 tokens, ``(document, chunk within it)``; rows past the real chunks
    ``(-1, 0)`` (FLA's fixed-shape form). Static shapes, no host read."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    counts = (lens + CHUNK_SIZE - 1).div(CHUNK_SIZE, rounding_mode="floor")
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    slots = torch.arange(rows, device=cu_seqlens.device, dtype=offsets.dtype)
    doc = (torch.searchsorted(offsets, slots, right=True) - 1).clamp(max=max(lens.shape[0] - 1, 0))
    valid = slots < offsets[-1]
    chunk = slots - offsets[doc] if lens.shape[0] else slots
    return torch.stack([torch.where(valid, doc, -1), torch.where(valid, chunk, 0)], 1)


def check_chunk_indices(chunk_indices: object, cu_seqlens: torch.Tensor | None) -> None:
    """``chunk_indices`` ``[NT, 2]``: FLA's precomputed chunk table; the
    kernels cut their own, so it is only checked against ``cu_seqlens``
    (exactly, or FLA's fixed-shape form padded with ``(-1, 0)`` rows)."""
    if chunk_indices is None:
        return
    if cu_seqlens is None:
        raise ValueError("chunk_indices was given without cu_seqlens: they index the chunks of its documents")
    check_tensor("chunk_indices", chunk_indices, 2, "[NT, 2]")
    if chunk_indices.dtype not in INDEX_DTYPES:
        raise TypeError(f"chunk_indices must be int32 or int64, got {chunk_indices.dtype}")
    if chunk_indices.shape[1] != 2:
        raise ValueError(f"chunk_indices must be [NT, 2], got shape {tuple(chunk_indices.shape)}")
    rows = chunk_indices.shape[0]
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    enough = (lens + CHUNK_SIZE - 1).div(CHUNK_SIZE, rounding_mode="floor").sum() <= rows
    if cu_seqlens.device.type == "cpu" and values_readable(cu_seqlens):
        if not bool(enough):
            raise ValueError(f"chunk_indices has {rows} rows, fewer than the chunks of cu_seqlens")
    else:
        torch._assert_async(enough, "chunk_indices has fewer rows than the chunks of cu_seqlens")
    _check_equal("chunk_indices", chunk_indices.to(cu_seqlens.device), expected_chunk_indices(cu_seqlens, rows),
                 f"the chunks of {CHUNK_SIZE} tokens of cu_seqlens")


def states_v_first(state: torch.Tensor | None) -> torch.Tensor | None:
    """A state between FLA's ``state_v_first`` layout ``[N, HV, V, K]`` and
    ours ``[N, HV, K, V]`` (the same swap both ways)."""
    return None if state is None else state.transpose(-1, -2)
