"""Every public byte query and WorkspaceKcp takes ``dtype=`` the input dtype
(float16, bfloat16, float32, float64) and refuses anything else, naming
``dtype`` and the value."""

from __future__ import annotations

import functools

import pytest
import torch

from gdn_kcp import WorkspaceKcp
from gdn_kcp.context import context_from_split, default_ranges
from gdn_kcp.queries import (
    gdn_comm_bytes_kcp,
    gdn_det_comm_bytes_kcp,
    gdn_det_saved_bytes_kcp,
    gdn_det_saved_layout_kcp,
    gdn_det_workspace_bytes_kcp,
    gdn_det_workspace_layout_kcp,
    gdn_saved_bytes_kcp,
    gdn_saved_layout_kcp,
    gdn_state_layout_kcp,
    gdn_workspace_bytes_kcp,
    gdn_workspace_layout_kcp,
)

CTX = context_from_split([0, 384], default_ranges(384, 3), 1)  # a middle rank: every figure > 0
SHAPED = [
    gdn_workspace_layout_kcp, gdn_workspace_bytes_kcp, gdn_saved_layout_kcp, gdn_saved_bytes_kcp,
    gdn_det_workspace_layout_kcp, gdn_det_workspace_bytes_kcp, gdn_det_saved_layout_kcp, gdn_det_saved_bytes_kcp,
    functools.partial(WorkspaceKcp, device="cpu"),
]
QUERIES = [functools.partial(query, CTX, 1, 2, 16, 16) for query in SHAPED] + [
    functools.partial(query, CTX, 2, 16, 16) for query in (gdn_comm_bytes_kcp, gdn_det_comm_bytes_kcp)
] + [functools.partial(gdn_state_layout_kcp, context_from_split([0, 100, 384], default_ranges(384, 3), 0), 2, 16, 16)]
# (the state query at rank 0, where documents start and end: a middle rank holds no state)
NAMES = [query.func.__name__ for query in QUERIES]


@pytest.mark.parametrize("query", QUERIES, ids=NAMES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64,
                                   torch.float8_e4m3fn])
def test_non_float_dtype_refused(query, dtype):
    with pytest.raises(ValueError, match=rf"dtype must be one of float16, bfloat16, float32, float64 .* got {dtype}$"):
        query(dtype=dtype)


@pytest.mark.parametrize("query", QUERIES, ids=NAMES)
@pytest.mark.parametrize("dtype", ["bf16", "float32", 4, None])
def test_non_dtype_refused(query, dtype):
    with pytest.raises(TypeError, match=rf"dtype must be a torch.dtype, .* got {type(dtype).__name__} {dtype!r}"):
        query(dtype=dtype)


def total_bytes(result) -> int:
    if isinstance(result, int):
        return result
    if isinstance(result, WorkspaceKcp):
        return result.nbytes
    if isinstance(result, dict) and "c1" in result:
        return sum(sum(sides.values()) for sides in result.values())
    if isinstance(result, dict):
        return sum(spec.nbytes for spec in result.values())
    return result.bytes


@pytest.mark.parametrize("query", QUERIES, ids=NAMES)
def test_float_dtypes_accepted(query):
    """fp16 / bf16 / fp32 compute in fp32, fp64 in fp64; fp16 and bf16 keep
    the same 2-byte tapes, fewer bytes than fp32 wherever a tape is counted
    (test_workspace_layout checks each pool's dtype)."""
    figures = {dtype: total_bytes(query(dtype=dtype)) for dtype in (torch.float16, torch.bfloat16, torch.float32)}
    assert figures[torch.float16] == figures[torch.bfloat16] > 0, figures
    counts_tapes = query.func not in (gdn_comm_bytes_kcp, gdn_det_comm_bytes_kcp, gdn_state_layout_kcp) and (
        "saved" not in query.func.__name__)  # light mode saves no tape
    assert (figures[torch.bfloat16] < figures[torch.float32]) == counts_tapes, figures
    assert figures[torch.bfloat16] <= figures[torch.float32], figures
    assert total_bytes(query(dtype=torch.float64)) > figures[torch.float32]
