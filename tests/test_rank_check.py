"""GDN_KCP_CHECK_RANKS=1: a rank that passes another token count, HV, dtype,
use_qk_l2norm, context or malformed inputs makes every rank raise a ValueError
naming the field, instead of leaving the other ranks in a collective until the
timeout; matching inputs give the same result at the cost of one all_gather of
the size docs/troubleshooting.md states."""

from __future__ import annotations

import os
import re
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from gdn_inputs import make_inputs
from spawn import spawn_ranks

from gdn_kcp import build_kcp_context, gdn_kcp
from gdn_kcp.context import context_from_split
from gdn_kcp.rank_check import ENV_VAR, check_ranks_agree, check_ranks_enabled

TROUBLESHOOTING = Path(__file__).resolve().parent.parent / "docs" / "troubleshooting.md"
BOUNDS = [0, 40, 130, 200]  # the middle document crosses the default split at 100
T, H_qk, HV, K, V = 200, 1, 2, 16, 16


def _forward_backward(ctx, inputs, **kwargs):
    leaves = [x.clone().requires_grad_() for x in inputs]
    o, _ = gdn_kcp(*leaves, ctx, **kwargs)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(ctx.rank), dtype=o.dtype)
    return [o.detach(), *torch.autograd.grad((o * do).sum(), leaves)]


def _on_rank_1(rank: int, ours, theirs):
    return theirs if rank == 1 else ours


def _every_rank_raises(rank: int, R: int) -> None:
    # A short timeout: a regression fails here instead of hanging the test run.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    ctx = build_kcp_context(BOUNDS, group)
    start, end = ctx.rank_ranges[rank]
    mine = [x[:, start:end] for x in make_inputs(T, H_qk, HV, K, V)]

    # Matching inputs: the same output and gradients, and exactly one more all_gather.
    results = {}
    for switch in ("0", "1"):
        os.environ[ENV_VAR] = switch
        with mock.patch.object(dist, "all_gather", wraps=dist.all_gather) as all_gather:
            results[switch] = _forward_backward(ctx, mine)
        assert all_gather.call_count == int(switch), (switch, all_gather.call_count)
    gathered = all_gather.call_args.args[1]
    stated = re.search(r"one all-gather of a `\[(\d+)\]` int64 tensor", TROUBLESHOOTING.read_text())
    assert stated and gathered.dtype == torch.int64 and gathered.numel() == int(stated[1]), gathered.shape
    for off, on in zip(results["0"], results["1"]):
        assert torch.equal(off, on)

    other_HV = [x[:, start:end] for x in make_inputs(T, H_qk, 2 * HV, K, V)]
    short_v = [*mine[:2], mine[2][:, :-3], *mine[3:]]
    cases = [
        ("T", _on_rank_1(rank, mine, [x[:, :-5] for x in mine]), {},
         r"ranks \[1\] pass a token count T that disagrees with the context \(rank 1: T = 95, "
         r"rank_ranges\[1\] = \(100, 200\) holds 100\)"),
        ("HV", _on_rank_1(rank, mine, other_HV), {}, r"ranks \[1\] differ from rank 0 in HV \(2 vs 4\)"),
        ("dtype", _on_rank_1(rank, mine, [x.float() for x in mine]), {},
         r"ranks \[1\] differ from rank 0 in dtype \(float64 vs float32\)"),
        ("use_qk_l2norm", mine, {"use_qk_l2norm": rank == 1},
         r"ranks \[1\] differ from rank 0 in use_qk_l2norm \(False vs True\)"),
        ("malformed v", _on_rank_1(rank, mine, short_v), {},
         r"the inputs of ranks \[1\] fail gdn_kcp's input checks"),
        ("beta sigmoid", mine, {"use_beta_sigmoid_in_kernel": rank == 1},
         r"ranks \[1\] differ from rank 0 in use_beta_sigmoid_in_kernel \(0 vs 1\)"),
        # a keyword error that gdn_kcp raises before its input checks: still every rank, at once
        ("allow_neg_eigval alone", mine, {"allow_neg_eigval": rank == 1},
         r"ranks \[1\] differ from rank 0 in allow_neg_eigval \(0 vs 1\).*the inputs of ranks \[1\] fail"),
        ("output_final_state", mine, {"output_final_state": rank == 1},
         r"ranks \[1\] differ from rank 0 in output_final_state \(0 vs 1\)"),
        ("initial_state rows", mine, {"initial_state": torch.zeros(ctx.n_start_docs + rank, HV, K, V,
                                                                   dtype=torch.float64)},
         r"the inputs of ranks \[1\] fail gdn_kcp's input checks"),
    ]
    # Rank 1 splits at 90 instead of 100 and passes the 110 tokens its context gives it.
    other_split = context_from_split(BOUNDS, [(0, 90), (90, 200)], rank, group=group, group_name=ctx.group_name)
    cases.append(("context", _on_rank_1(rank, mine, [x[:, 90:] for x in make_inputs(T, H_qk, HV, K, V)]),
                  {"ctx": _on_rank_1(rank, ctx, other_split)}, r"ranks \[1\] hold another context than rank 0"))
    for name, inputs, kwargs, message in cases:
        call_ctx = kwargs.pop("ctx", ctx)
        with pytest.raises(ValueError, match=f"^{ENV_VAR}: .*{message}") as raised:
            gdn_kcp(*inputs, call_ctx, **kwargs)
        if name == "malformed v" and rank == 1:  # the failing rank also says why
            assert "v must be [B, T, HV, V]" in str(raised.value)

    # While torch.compile traces, the check is skipped (no graph break, no raise).
    def traced(*inputs):
        check_ranks_agree(ctx, *inputs, scale=None, options=None)
        return inputs[0] + 1

    compiled = torch.compile(traced, backend="eager", fullgraph=True)
    assert torch.equal(compiled(*cases[0][1]), cases[0][1][0] + 1)

    # The group is still in step after all of that.
    assert all(torch.equal(a, b) for a, b in zip(_forward_backward(ctx, mine), results["0"]))
    os.environ[ENV_VAR] = "0"


def test_mismatched_rank_makes_every_rank_raise():
    spawn_ranks(2, _every_rank_raises)


@pytest.mark.parametrize("value, enabled", [("1", True), ("true", True), (" On ", True), ("0", False),
                                            ("", False), ("false", False), (None, False)])
def test_switch_values(monkeypatch, value, enabled):
    if value is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, value)
    assert check_ranks_enabled() is enabled


def test_one_rank_needs_no_collective(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    ctx = build_kcp_context(BOUNDS)
    inputs = make_inputs(T, H_qk, HV, K, V)
    with mock.patch.object(dist, "all_gather") as all_gather:
        o, _ = gdn_kcp(*inputs, ctx)
    assert all_gather.call_count == 0
    assert o.shape == (1, T, HV, V)


def _held_workspace_checks_once(rank: int, R: int) -> None:
    """Without the switch: building capped contexts runs one all_gather for the
    caps, then none per step; the first call through a held workspace runs one,
    later calls none; a rank whose HV or use_qk_l2norm differs makes every rank
    raise at its first call, naming the field."""
    from gdn_kcp import OptionsKcp, WorkspaceKcp

    os.environ[ENV_VAR] = "0"
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    with mock.patch.object(dist, "all_gather", wraps=dist.all_gather) as all_gather:
        contexts = [build_kcp_context(bounds, group, max_docs=4) for bounds in (BOUNDS, [0, 150, 200], [0, 200])]
    assert all_gather.call_count == 1, all_gather.call_count
    start, end = contexts[0].rank_ranges[rank]
    mismatches = (("HV", _on_rank_1(rank, HV, 2 * HV), False), ("use_qk_l2norm", HV, _on_rank_1(rank, False, True)))
    for field, hv, l2 in mismatches:
        options = OptionsKcp(use_qk_l2norm=l2)
        workspace = WorkspaceKcp(contexts[0], H_qk, hv, K, V, dtype=torch.float64, options=options)
        mine = [x[:, start:end] for x in make_inputs(T, H_qk, hv, K, V)]
        expected = rf"first call through this WorkspaceKcp: ranks \[1\] differ from rank 0 in {field}"
        with pytest.raises(ValueError, match=expected):
            gdn_kcp(*mine, contexts[0], options=options, workspace=workspace)
    options = OptionsKcp()
    workspace = WorkspaceKcp(contexts[0], H_qk, HV, K, V, dtype=torch.float64, options=options)
    mine = [x[:, start:end] for x in make_inputs(T, H_qk, HV, K, V)]
    for step, ctx in enumerate(contexts):
        with mock.patch.object(dist, "all_gather", wraps=dist.all_gather) as all_gather:
            gdn_kcp(*mine, ctx, options=options, workspace=workspace)
        assert all_gather.call_count == (1 if step == 0 else 0), (step, all_gather.call_count)


def test_held_workspace_checks_the_ranks_once():
    spawn_ranks(2, _held_workspace_checks_once)


def _capped_packings_differ(rank: int, R: int) -> None:
    """Capped contexts have the same caps and layout for every packing; with the
    switch on, a rank built from another packing is still named."""
    os.environ[ENV_VAR] = "1"
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    bounds = _on_rank_1(rank, [0, 100, 200], [0, 30, 200])
    ctx = build_kcp_context(bounds, group, max_docs=4)
    start, end = ctx.rank_ranges[rank]
    mine = [x[:, start:end] for x in make_inputs(T, H_qk, HV, K, V)]
    with pytest.raises(ValueError, match=r"ranks \[1\] hold another context than rank 0"):
        gdn_kcp(*mine, ctx)


def test_capped_contexts_of_other_packings_are_named():
    spawn_ranks(2, _capped_packings_differ)
