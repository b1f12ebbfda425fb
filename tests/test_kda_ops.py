"""KDA through the ops, as GDN goes through them: opcheck of both ops (one rank
and 2 gloo ranks), torch.compile(fullgraph=True) against eager, capture once
over packings (chunk_kda with a fixed-length cu_seqlens, kda_kcp on capped
contexts), FakeTensor memory tracing equal to the real run, and activation
checkpointing with the recompute options bitwise equal to the step without."""

from __future__ import annotations

import pytest
import torch
from capture_cases import flat_loop, kcp_loop
from checkpoint_cases import BOUNDS, Model, assert_bitwise
from ops_cases import checkpoint_equals_plain, compiled_equals_eager, opcheck_both_ops
from spawn import spawn_ranks
from test_ops import training_step
from torch._subclasses.fake_tensor import FakeTensorMode

from gdn_kcp import OptionsKcp, build_kcp_context, kda_kcp, kda_workspace_layout_kcp
from gdn_kcp.checkpointing import last_checkpoint_record


def test_opcheck_single_rank():
    opcheck_both_ops(kda=True)


def test_compile_fullgraph_and_checkpoint_single_rank():
    compiled_equals_eager(kda=True)
    checkpoint_equals_plain(kda=True)


def _two_rank_checks(rank: int, R: int) -> None:
    opcheck_both_ops(rank, R, kda=True)
    compiled_equals_eager(rank, R, kda=True)


def test_two_rank_group():
    spawn_ranks(2, _two_rank_checks)


def test_chunk_kda_compiles_once_over_packings():
    flat_loop(kda=True)


def test_kda_kcp_capped_contexts_compile_once_two_ranks():
    spawn_ranks(2, kcp_loop, True)


@pytest.mark.parametrize("caller_workspace", [False, True])
def test_fake_tensor_memory_tracing_equals_the_real_run(caller_workspace):
    real, real_workspaces = training_step(caller_workspace, kda=True)
    with FakeTensorMode():
        fake, fake_workspaces = training_step(caller_workspace, kda=True)
    assert fake == real and fake_workspaces == real_workspaces
    layout = kda_workspace_layout_kcp(build_kcp_context([0, 50, 50, 130]), 2, 4, 16, 16,
                                      options=OptionsKcp(use_qk_l2norm=True))
    if caller_workspace:
        assert real["_MemRefType.OTH"] == layout.bytes and real_workspaces == []
    else:
        assert real_workspaces == [[layout.fwd.bytes], [layout.bwd.bytes]]


CHANNELS = torch.tensor([0.5, 1.0, 1.5, 2.0] * 4, dtype=torch.float64)
"""Per-channel multiples of the model's head gate (dyadic: the channel gates are exact)."""


def kda_core(options: OptionsKcp):
    ctx = build_kcp_context(list(BOUNDS))

    def core(q, k, v, g, beta):
        return kda_kcp(q, k, v, g[..., None] * CHANNELS.to(g.dtype), beta, ctx, options=options)[0]
    return core


@pytest.mark.parametrize("save_mode", ["light", "inverse", "full"])
@pytest.mark.parametrize("region", ["core", "later"])
def test_checkpointed_gradients_are_bitwise_the_step_without(region, save_mode):
    """Under a non-reentrant checkpoint, every recompute option gives the
    gradients of the step without checkpoint, bitwise; the recompute keeps
    the tapes exactly when GDN's does."""
    expected = Model(torch.float64).step(region, "none", kda_core(OptionsKcp(save_mode=save_mode, use_qk_l2norm=True)))
    for reuse in (None, True, False):
        got = Model(torch.float64).step(region, "checkpoint",
                                        kda_core(OptionsKcp(save_mode=save_mode, reuse_recompute_tapes=reuse,
                                                            use_qk_l2norm=True)))
        assert_bitwise(expected, got, f"{region}, {save_mode}, reuse {reuse}")
        record = last_checkpoint_record()
        assert record.phase == "recompute" and record.executable, record
        keeps = save_mode != "full" and (reuse is True or (reuse is None and region == "core"))
        assert record.kept_tapes == keeps, record
