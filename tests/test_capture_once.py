"""Capture once (docs/design.md, "Capture once"): torch.compile(fullgraph=True) over a new
random packing every step adds no graph after the first, flat through
chunk_gated_delta_rule and through gdn_kcp on capped contexts on one rank and
on a 2-rank gloo group; compiled results equal eager every step. FakeTensor
memory tracing of a capped context equals the real run, for any packing."""

from __future__ import annotations

from capture_cases import LENGTHS_SEEN, flat_loop, kcp_loop
from spawn import spawn_ranks


def test_flat_fixed_length_cu_seqlens_compiles_once():
    flat_loop()


def test_flat_cu_seqlens_of_changing_length_compiles_once_per_length():
    """Without the fixed-length convention the document count is specialised:
    one graph per distinct length (the fixed length is the one-graph form)."""
    assert flat_loop(cu_length=None) == LENGTHS_SEEN


def test_kcp_capped_contexts_compile_once_single_rank():
    kcp_loop()


def test_kcp_capped_contexts_compile_once_two_ranks():
    spawn_ranks(2, kcp_loop)
