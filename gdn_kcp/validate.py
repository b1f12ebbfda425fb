"""Input checks of the public functions: every error names the argument and its value."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gdn_kcp.dtypes import FLOAT_DTYPES

INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class GdnDims:
    """Sizes read off valid inputs: ``N`` documents of a ``B x T`` token batch."""

    B: int
    T: int
    H_qk: int
    HV: int
    K: int
    V: int
    N: int


def check_tensor(name: str, x: object, ndim: int, layout: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be a {ndim}-D tensor {layout}, got shape {tuple(x.shape)}")
    return x


def check_float_dtype(name: str, x: torch.Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}; supported: float16, bfloat16, float32, float64")


def check_scale(scale: object) -> None:
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__} {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")


def check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def qk_norm_flag(use_qk_l2norm_in_kernel: object, use_qk_l2norm: object) -> tuple[bool | None, str]:
    """The q/k norm switch under either of its names (FLA's, and the older
    ``use_qk_l2norm``), each checked, and the name the caller used: ``(None,
    "")`` when neither is given."""
    given = [(name, value) for name, value in (("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
                                               ("use_qk_l2norm", use_qk_l2norm)) if value is not None]
    for name, value in given:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool or None, got {type(value).__name__} {value!r}")
    if len(given) == 2 and use_qk_l2norm != use_qk_l2norm_in_kernel:
        raise ValueError(f"use_qk_l2norm_in_kernel={use_qk_l2norm_in_kernel} disagrees with "
                         f"use_qk_l2norm={use_qk_l2norm}: they name the same switch")
    return (given[0][1], given[0][0]) if given else (None, "")


def values_readable(x: torch.Tensor) -> bool:
    """False for a tensor whose values the host cannot read yet: one traced by
    torch.compile, or a FakeTensor (FakeTensorMode). A meta tensor has no
    values at all, and its readers say so."""
    if torch.compiler.is_compiling():
        return False
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(x)


def check_bounds_tensor(name: str, cu_seqlens: object) -> None:
    """What can be checked of a ``cu_seqlens`` without reading it: a 1-D int32/int64 tensor."""
    check_tensor(name, cu_seqlens, 1, "[N + 1]")
    if cu_seqlens.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {cu_seqlens.dtype}")


def check_cu_seqlens(cu_seqlens: object, T: int | None, name: str = "cu_seqlens") -> list[int]:
    """Validate ``cu_seqlens`` ``[N + 1]`` (ending at ``T`` when given) and
    return its values (a host read)."""
    check_bounds_tensor(name, cu_seqlens)
    if cu_seqlens.is_meta:
        raise ValueError(
            f"{name} is on device {cu_seqlens.device}, which holds no values, and its values are read on the host: "
            f"pass it on the CPU or a GPU"
        )
    return check_bounds(name, cu_seqlens.tolist(), T)


def check_cu_seqlens_traced(cu_seqlens: object, T: int, name: str = "cu_seqlens") -> None:
    """What can be checked of ``cu_seqlens`` without reading it (its type,
    rank and dtype), plus device-side asserts of its values (start at 0,
    non-decreasing, end at ``T``): for a traced tensor, where a host read
    would break the graph, and a fake one, which has no values. A bad value
    fails the step at its next sync."""
    check_bounds_tensor(name, cu_seqlens)
    if cu_seqlens.shape[0] == 0:
        raise ValueError(f"{name} must start at 0, got an empty tensor")
    torch._assert_async(cu_seqlens[0] == 0, f"{name} must start at 0")
    torch._assert_async(cu_seqlens[-1] == T, f"{name} must end at T = {T}")
    torch._assert_async((cu_seqlens[1:] >= cu_seqlens[:-1]).all(), f"{name} must be non-decreasing")


def check_max_docs(max_docs: object, n_docs: int, source: str) -> None:
    """``max_docs``: a positive int at least the ``n_docs`` documents of ``source``."""
    if isinstance(max_docs, bool) or not isinstance(max_docs, int):
        raise TypeError(f"max_docs must be an int or None, got {type(max_docs).__name__} {max_docs!r}")
    if max_docs < 1:
        raise ValueError(f"max_docs must be at least 1, got {max_docs}")
    if n_docs > max_docs:
        raise ValueError(
            f"{source} holds {n_docs} documents, more than max_docs = {max_docs}: raise the cap "
            f"(one value for the whole run) or split the packing"
        )


def check_bounds(name: str, values: object, T: int | None) -> list[int]:
    """Document bounds ``[0, ..., T]``: start at 0, non-decreasing, end at ``T``
    (when given)."""
    if any(isinstance(x, bool) or not isinstance(x, int) for x in values):
        raise TypeError(f"{name} must hold ints, got {list(values)[:4]}")
    bounds = [int(x) for x in values]
    if not bounds or bounds[0] != 0:
        raise ValueError(f"{name} must start at 0, got {bounds[:4]}")
    drops = [i for i in range(len(bounds) - 1) if bounds[i + 1] < bounds[i]]
    if drops:
        i = drops[0]
        raise ValueError(
            f"{name} must be non-decreasing, got {name}[{i}] = {bounds[i]} > {name}[{i + 1}] = {bounds[i + 1]}"
        )
    if T is not None and bounds[-1] != T:
        raise ValueError(f"{name} must end at T = {T}, got {name}[-1] = {bounds[-1]}")
    return bounds


def check_gdn_inputs(
    q: object,
    k: object,
    v: object,
    g: object,
    beta: object,
    *,
    scale: object,
    initial_state: object,
    cu_seqlens: object,
    initial_rows: tuple[int, str] | None = None,
    cu_seqlens_host: torch.Tensor | None = None,
    state_v_first: bool = False,
    gate: str = "head",
) -> tuple[GdnDims, list[int] | None]:
    """Check the FLA-layout inputs; return their sizes and the document bounds
    over the flattened ``B * T`` tokens (None for a ``cu_seqlens`` whose
    values the host cannot read, traced or fake, checked by
    :func:`check_cu_seqlens_traced`). ``initial_rows`` (count, symbol) sets
    the rows initial_state must have when they are not the N documents (a KCP
    rank holds the documents that start on it). ``cu_seqlens_host``: a host
    copy of ``cu_seqlens`` to read instead of it (FLA's ``cu_seqlens_cpu``:
    no device sync), checked to equal it by the caller. ``state_v_first``:
    initial_state is ``[N, HV, V, K]`` (FLA's V-first layout). ``gate="channel"``:
    g is ``[B, T, HV, K]``, a gate per key channel (KDA)."""
    check_tensor("q", q, 4, "[B, T, H_qk, K]")
    check_tensor("k", k, 4, "[B, T, H_qk, K]")
    check_tensor("v", v, 4, "[B, T, HV, V]")
    per_channel = gate == "channel"
    check_tensor("g", g, 4 if per_channel else 3, "[B, T, HV, K]" if per_channel else "[B, T, HV]")
    check_tensor("beta", beta, 3, "[B, T, HV]")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_float_dtype(name, x)
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}: all inputs must share a device")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}, q has {q.dtype}: q, k, v must share a dtype")
    B, T, H_qk, K = q.shape
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with B, T = {B}, {T} (from q), got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if per_channel and g.shape != (B, T, HV, K):
        raise ValueError(f"g must have shape [B, T, HV, K] = {(B, T, HV, K)} (a gate per key channel), "
                         f"got {tuple(g.shape)}")
    for name, x in (("g", g), ("beta", beta))[per_channel:]:
        if x.shape != (B, T, HV):
            raise ValueError(f"{name} must have shape [B, T, HV] = {(B, T, HV)}, got {tuple(x.shape)}")
    if H_qk == 0 or HV % H_qk != 0:
        raise ValueError(f"HV = {HV} (v.shape[2]) must be a multiple of H_qk = {H_qk} (q.shape[2])")
    if K == 0 or V == 0:
        raise ValueError(f"head dims must be positive, got K = {K}, V = {V}")
    check_scale(scale)

    if cu_seqlens is None:
        bounds = [b * T for b in range(B + 1)]
    else:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be 1 (packed), got B = {B}")
        if cu_seqlens_host is not None and values_readable(cu_seqlens_host):
            check_bounds_tensor("cu_seqlens", cu_seqlens)  # its values are the host copy's
            bounds = check_cu_seqlens(cu_seqlens_host, T, name="cu_seqlens_cpu")
        elif not values_readable(cu_seqlens):
            check_cu_seqlens_traced(cu_seqlens, T)
            bounds = None
        else:
            bounds = check_cu_seqlens(cu_seqlens, T)
    N = len(bounds) - 1 if bounds is not None else cu_seqlens.shape[0] - 1
    if initial_state is not None:
        rows, rows_name = (N, "N") if initial_rows is None else initial_rows
        layout, shape = (f"[{rows_name}, HV, V, K]", (rows, HV, V, K)) if state_v_first else \
            (f"[{rows_name}, HV, K, V]", (rows, HV, K, V))
        check_tensor("initial_state", initial_state, 4, layout)
        check_float_dtype("initial_state", initial_state)
        if initial_state.shape != shape:
            raise ValueError(f"initial_state must have shape {layout} = {shape}, got {tuple(initial_state.shape)}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device}, q on {q.device}")
    return GdnDims(B=B, T=T, H_qk=H_qk, HV=HV, K=K, V=V, N=N), bounds
