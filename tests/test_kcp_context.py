"""KcpContext construction (pure, no process group), option and input checks,
and the comm-byte query's shape: constant per rank whatever R."""

from __future__ import annotations

import pytest
import torch
from gdn_inputs import make_inputs

from gdn_kcp import OptionsKcp, build_kcp_context, gdn_comm_bytes_kcp, gdn_kcp
from gdn_kcp.context import check_ranges, context_from_split, default_ranges
from gdn_kcp.kernels import CROSSING_IN, CROSSING_OUT, ChunkIndex


def test_default_split_is_contiguous_and_even():
    assert default_ranges(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert default_ranges(2, 4) == [(0, 0), (0, 1), (1, 1), (1, 2)]


def test_fragment_tables():
    bounds = [0, 5, 5, 100, 130, 130]  # zero-length documents at 5 and at T
    ranges = [(0, 40), (40, 40), (40, 90), (90, 130)]
    ctx = context_from_split(bounds, ranges, 2)
    assert ctx.n_tokens == 50 and ctx.n_frag == 1
    assert ctx.index.frag_doc.tolist() == [2]
    assert ctx.index.frag_flags.tolist() == [CROSSING_IN | CROSSING_OUT]
    assert ctx.rank_n_in == (0, 0, 1, 1) and ctx.rank_n_out == (1, 0, 1, 0)
    assert ctx.rank_middle == (0, 0, 1, 0)
    assert ctx.chains == ((0, 2, 3),)  # the empty rank 1 holds no fragment
    assert ctx.rank_prev == (-1, -1, 0, 2) and ctx.rank_next == (2, -1, 3, -1)
    first = context_from_split(bounds, ranges, 0)
    assert first.index.frag_doc.tolist() == [0, 1, 2]
    assert first.index.frag_start.tolist() == [0, 5, 5] and first.index.frag_len.tolist() == [5, 0, 35]
    assert first.index.frag_flags.tolist() == [0, 0, CROSSING_OUT]
    last = context_from_split(bounds, ranges, 3)
    assert last.index.frag_doc.tolist() == [2, 3, 4]
    assert last.index.frag_flags.tolist() == [CROSSING_IN, 0, 0]
    assert last.index.frag_len.tolist() == [10, 30, 0]


def test_documents_ending_on_a_boundary_do_not_cross():
    ctx = context_from_split([0, 64, 128], [(0, 64), (64, 128)], 1)
    assert not ctx.exchanges and ctx.chains == ()


def test_single_process_context():
    ctx = build_kcp_context(torch.tensor([0, 10, 30]))
    assert (ctx.R, ctx.rank, ctx.rank_ranges, ctx.group_name) == (1, 0, ((0, 30),), "")


@pytest.mark.parametrize(
    "ranges,match",
    [
        ([(0, 10)], r"one \(start, end\) per rank \(R = 2\)"),
        ([(0, 10), (10, 20)], r"must cover \[0, T = 30\)"),
        ([(0, 10), (12, 30)], r"contiguous, got rank_ranges\[0\] = \(0, 10\) and rank_ranges\[1\] = \(12, 30\)"),
        ([(0, 20), (20, 15), (15, 30)], r"rank_ranges\[1\] = \(20, 15\) ends before it starts"),
    ],
)
def test_bad_rank_ranges(ranges, match):
    R = 3 if len(ranges) == 3 else 2
    with pytest.raises(ValueError, match=match):
        check_ranges(ranges, 30, R)


def test_owner_slices_pad_the_last():
    ctx = context_from_split([0, 100], default_ranges(100, 4), 0)
    assert (ctx.owner_heads(6), ctx.padded_heads(6)) == (2, 8)
    ctx5 = context_from_split([0, 100], default_ranges(100, 5), 0)
    assert (ctx5.owner_heads(12), ctx5.padded_heads(12)) == (3, 15)
    assert (ctx5.owner_heads(48), ctx5.padded_heads(48)) == (10, 50)


def test_a2a_traffic_per_rank_is_independent_of_R():
    """One document over every rank: a middle rank sends one padded summary and
    receives one padded state, and as an owner receives at most s_pad heads of
    summaries, whatever R; an all-gather would receive R * HV."""
    HV, K, V = 48, 128, 128
    for R in (3, 4, 8, 16):
        ctx = context_from_split([0, 16 * R], default_ranges(16 * R, R), 1)
        assert ctx.rank_middle[1] == 1
        s_pad = ctx.padded_heads(HV)
        assert s_pad < HV + R
        comm = gdn_comm_bytes_kcp(ctx, HV, K, V)
        assert comm["c1"]["send"] == s_pad * K * (K + V) * 4
        assert comm["c2"]["recv"] == s_pad * K * V * 4
        assert comm["c1"]["recv"] <= s_pad * K * (K + V) * 4 < R * HV * K * (K + V) * 4


def test_comm_bytes_options():
    ctx = context_from_split([0, 100], default_ranges(100, 2), 0)
    a2a = gdn_comm_bytes_kcp(ctx, 4, 16, 16)
    ring = gdn_comm_bytes_kcp(ctx, 4, 16, 16, exchange="ring")
    assert ring == gdn_comm_bytes_kcp(ctx, 4, 16, 16, options=OptionsKcp(exchange="ring"))
    assert ring["c1"] == {"send": 4 * 16 * 16 * 4, "recv": 0} and ring["c2"] == {"send": 0, "recv": 0}
    assert a2a["c1"]["send"] == 4 * 16 * 16 * 4
    assert gdn_comm_bytes_kcp(ctx, 4, 16, 16, dtype=torch.float64)["c1"]["send"] == 2 * a2a["c1"]["send"]
    with pytest.raises(ValueError, match=r"exchange='ring' disagrees with options.exchange='a2a'"):
        gdn_comm_bytes_kcp(ctx, 4, 16, 16, exchange="ring", options=OptionsKcp())


def test_bad_options():
    with pytest.raises(ValueError, match=r"OptionsKcp.exchange must be one of \('a2a', 'ring'\), got 'nccl'"):
        OptionsKcp(exchange="nccl")
    with pytest.raises(ValueError, match=r"OptionsKcp.use_qk_l2norm must be a bool, got 1"):
        OptionsKcp(use_qk_l2norm=1)


def test_gdn_kcp_input_checks():
    ctx = build_kcp_context(torch.tensor([0, 20, 40]))
    q, k, v, g, beta = make_inputs(40, 1, 2, 8, 8)
    with pytest.raises(TypeError, match=r"ctx must be a KcpContext \(from build_kcp_context\), got dict"):
        gdn_kcp(q, k, v, g, beta, {})
    with pytest.raises(ValueError, match=r"q holds T = 39 tokens but rank 0 of the context holds 40"):
        gdn_kcp(q[:, 1:], k[:, 1:], v[:, 1:], g[:, 1:], beta[:, 1:], ctx)
    with pytest.raises(TypeError, match=r"options must be an OptionsKcp or None, got str"):
        gdn_kcp(q, k, v, g, beta, ctx, options="ring")
    with pytest.raises(ValueError, match=r"use_qk_l2norm=True disagrees with options.use_qk_l2norm=False"):
        gdn_kcp(q, k, v, g, beta, ctx, use_qk_l2norm=True, options=OptionsKcp())
    qb, kb, vb, gb, betab = make_inputs(20, 1, 2, 8, 8, B=2)
    with pytest.raises(ValueError, match=r"gdn_kcp takes one packed row per rank \(B = 1\), got B = 2"):
        gdn_kcp(qb, kb, vb, gb, betab, ctx)


def test_one_rank_equals_chunk_gated_delta_rule():
    from gdn_kcp import chunk_gated_delta_rule

    bounds = torch.tensor([0, 20, 20, 90])
    ctx = build_kcp_context(bounds)
    inputs = make_inputs(90, 1, 2, 8, 8, l2=True, seed=3)
    o, _ = gdn_kcp(*inputs, ctx, use_qk_l2norm=True)
    ref, _ = chunk_gated_delta_rule(*inputs, cu_seqlens=bounds, use_qk_l2norm_in_kernel=True)
    assert torch.equal(o, ref)


def test_context_input_checks():
    with pytest.raises(ValueError, match=r"cu_seqlens_global must be a 1-D tensor \[N \+ 1\], got shape \(1, 2\)"):
        build_kcp_context(torch.tensor([[0, 5]]))
    with pytest.raises(TypeError, match=r"cu_seqlens_global must be int32 or int64, got torch.float32"):
        build_kcp_context(torch.tensor([0.0, 5.0]))
    with pytest.raises(ValueError, match=r"cu_seqlens_global must be non-decreasing"):
        build_kcp_context([0, 5, 3])
    with pytest.raises(TypeError, match=r"cu_seqlens_global must be a torch.Tensor or a list of ints"):
        build_kcp_context("0,5")


def test_options_are_keyword_only():
    with pytest.raises(TypeError):
        OptionsKcp(True, "full")


def test_index_on_another_device_than_q():
    ctx = build_kcp_context([0, 20, 40])
    q, k, v, g, beta = (x.to("meta") for x in make_inputs(40, 1, 2, 8, 8))
    with pytest.raises(ValueError, match=r"the context's index is on cpu but q is on meta"):
        gdn_kcp(q, k, v, g, beta, ctx)


def test_ops_refuse_non_contiguous_inputs():
    import gdn_kcp.ops  # noqa: F401

    ctx = build_kcp_context([0, 40])
    q, k, v, g, beta = (x[0].float() for x in make_inputs(40, 1, 2, 8, 8))
    wide = torch.zeros(40, 2, 16)[..., :8]  # every row strided by 32
    with pytest.raises(ValueError, match=r"v must be contiguous, got strides \(32, 16, 1\)"):
        torch.ops.gdn_kcp.fwd(q, k, wide, g, beta, None, torch.empty(1 << 20, dtype=torch.uint8),
                              ctx.index.chunk_table, ctx.index.frag_table, ctx.meta, "", OptionsKcp().op_arg, 0.3, 0,
                              None, False, 1.0)


def test_capped_index_holds_the_exact_index_then_sentinels():
    """Random packings, splits and caps: the capped tables start with the exact
    tables and are padded with sentinel rows (chunks of length 0, fragments
    flagged SENTINEL_FLAGS with document -1); their sizes are the caps'."""
    import random

    from gdn_kcp.context import rank_fragments
    from gdn_kcp.kernels.chunk_index import SENTINEL_FLAGS, capped_index, capped_sizes

    rng = random.Random(0)
    for _ in range(300):
        T = rng.randint(0, 400)
        bounds = [0, *sorted(rng.randint(0, T) for _ in range(rng.randint(0, 8))), T]
        max_docs = len(bounds) - 1 + rng.randint(0, 3)
        padded = bounds + [T] * (max_docs + 1 - len(bounds))
        R = rng.randint(1, 4)
        for r, (start, end) in enumerate(default_ranges(T, R)):
            frags = rank_fragments(padded, start, end, r == R - 1)
            exact = ChunkIndex.from_fragments([0] + [f[2] for f in frags] if frags else [0],
                                              frag_doc=[f[0] for f in frags], frag_flags=[f[3] for f in frags])
            capped = capped_index(torch.tensor(padded), start, end, last_rank=r == R - 1)
            where = (padded, start, end)
            assert (capped.n_chunks, capped.n_frag, capped.max_frag_chunks) == capped_sizes(end - start, max_docs)
            assert capped.n_chunks >= exact.n_chunks and capped.max_frag_chunks >= exact.max_frag_chunks, where
            assert torch.equal(capped.frag_table[:, : exact.n_frag], exact.frag_table), where
            assert torch.equal(capped.chunk_table[:, : exact.n_chunks], exact.chunk_table), where
            assert not capped.chunk_len[exact.n_chunks :].any(), where
            assert (capped.frag_flags[exact.n_frag :] == SENTINEL_FLAGS).all(), where
            assert (capped.frag_doc[exact.n_frag :] == -1).all(), where


def test_capped_sizes_are_reached():
    """The chunk cap is met by fragments of length 1 mod C (so it is the least cap)."""
    from gdn_kcp.kernels.chunk_index import capped_index, capped_sizes

    bounds = [0, 65, 130, 195, 260]  # four documents of 65 tokens: 2 chunks each
    assert capped_index(torch.tensor(bounds), 0, 260, last_rank=True).n_chunks == 8 == capped_sizes(260, 4)[0]
    assert int(capped_index(torch.tensor(bounds), 0, 260, last_rank=True).chunk_len.ne(0).sum()) == 8


def test_capped_contexts_share_one_layout():
    """Every packing of the same caps gives the same meta, layout key and byte
    figures; the states have max_docs rows and the documents' ids lead them."""
    from gdn_kcp import gdn_saved_bytes_kcp, gdn_workspace_bytes_kcp

    ranges = default_ranges(300, 3)
    packings = ([0, 300], [0, 10, 10, 150, 299, 300], [0, 100, 200, 300], [0, 0, 0, 0, 0, 300])
    for rank in range(3):
        contexts = [context_from_split(bounds, ranges, rank, max_docs=5) for bounds in packings]
        assert len({tuple(ctx.meta) for ctx in contexts}) == 1
        figures = {(gdn_workspace_bytes_kcp(ctx, 2, 4, 16, 16), gdn_saved_bytes_kcp(ctx, 2, 4, 16, 16))
                   for ctx in contexts}
        assert len(figures) == 1
        for ctx in contexts:
            assert ctx.capped and ctx.n_start_docs == ctx.n_end_docs == 5
    last = context_from_split([0, 150, 300], ranges, 2, max_docs=5)
    assert last.start_docs == [2, 3, 4] and last.end_docs == [1, 2, 3, 4]  # padding documents: on the last rank
    first = context_from_split([0, 150, 300], ranges, 0, max_docs=5)
    assert first.start_docs == [0] and first.end_docs == []


def test_over_cap_packing_names_max_docs():
    with pytest.raises(ValueError, match=r"cu_seqlens_global holds 3 documents, more than max_docs = 2"):
        build_kcp_context([0, 10, 20, 30], max_docs=2)
    for bad, error in ((0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="max_docs"):
            build_kcp_context([0, 10, 30], max_docs=bad)


def test_traced_cu_seqlens_is_checked_on_device():
    """Under torch.compile a bad cu_seqlens fails a device-side assert (no host read)."""
    from gdn_inputs import make_inputs

    from gdn_kcp import chunk_gated_delta_rule

    q, k, v, g, beta = make_inputs(100, 1, 2, 16, 16, dtype=torch.float32)
    compiled = torch.compile(lambda cu: chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)[0], fullgraph=True)
    assert compiled(torch.tensor([0, 40, 100, 100])).shape == (1, 100, 2, 16)
    for bad in ([0, 60, 40, 100], [0, 40, 100, 90], [5, 40, 100, 100]):
        with pytest.raises(RuntimeError, match="cu_seqlens must"):
            compiled(torch.tensor(bad))


def test_capped_index_compiled_equals_eager():
    """The index built in a compiled graph (as chunk_gated_delta_rule builds it)
    equals the eager build over random packings, on a whole range and a middle one."""
    import random

    from gdn_kcp.kernels.chunk_index import capped_index

    rng = random.Random(3)
    for start, end, last in ((0, 200, True), (50, 150, False)):
        def tables(cu):
            index = capped_index(cu, start, end, last_rank=last)
            return index.chunk_table, index.frag_table

        compiled = torch.compile(tables, fullgraph=True)
        for _ in range(30):
            cu = torch.tensor([0, *sorted(rng.randint(0, 200) for _ in range(5)), 200])
            for ours, eager in zip(compiled(cu), tables(cu)):
                assert torch.equal(ours, eager), (cu, start, end)
