"""torch.library ops: opcheck, torch.compile(fullgraph=True) with dynamic=False and
True, torch.utils.checkpoint, on one rank and on a 2-rank gloo group; FakeTensor
memory tracing against the real run; no host sync on the op call path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from gdn_layer import KcpLayer
from ops_cases import all_op_checks, checkpoint_equals_plain, compiled_equals_eager, opcheck_both_ops
from spawn import spawn_ranks
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

from gdn_kcp import OptionsKcp, WorkspaceKcp, build_kcp_context, gdn_workspace_layout_kcp

ROOT = Path(__file__).resolve().parent.parent


def test_opcheck_single_rank():
    opcheck_both_ops()


def test_compile_fullgraph_single_rank():
    compiled_equals_eager()


def test_checkpoint_single_rank():
    checkpoint_equals_plain()


def test_two_rank_group():
    spawn_ranks(2, all_op_checks)


class WorkspaceAllocations(TorchDispatchMode):
    """Records the sizes of the uint8 buffers allocated (the per-call workspaces)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.empty.memory_format and kwargs.get("dtype") == torch.uint8:
            self.sizes.append(list(args[0]))
        return func(*args, **kwargs)


def training_step(caller_workspace: bool, bounds=(0, 50, 50, 130), max_docs=None, kda=False) -> tuple[dict, list]:
    """Peak memory of one training step (forward, backward, optimizer) as
    MemTracker sees it, and the workspaces allocated in it; the same code runs
    real or under FakeTensorMode. ``kda``: the layer runs kda_kcp."""
    torch.manual_seed(0)
    ctx = build_kcp_context(list(bounds), max_docs=max_docs)  # a list: no tensor data read under fake mode
    options = OptionsKcp(use_qk_l2norm=True, gate="channel" if kda else "head")
    workspace = WorkspaceKcp(ctx, 2, 4, 16, 16, options=options) if caller_workspace else None
    layer = KcpLayer(ctx, options=options, workspace=workspace, kda=kda)
    optimizer = torch.optim.AdamW(layer.parameters())
    x = torch.randn(1, 130, 32)
    tracker = MemTracker()
    tracker.track_external(layer, optimizer, *([workspace.storage] if workspace is not None else []))
    with tracker, WorkspaceAllocations() as allocations:
        layer(x).square().sum().backward()
        optimizer.step()
    peak = {str(key): value for key, value in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    return peak, allocations.sizes


@pytest.mark.parametrize("caller_workspace", [False, True])
def test_fake_tensor_memory_tracing_equals_the_real_run(caller_workspace):
    real, real_workspaces = training_step(caller_workspace)
    with FakeTensorMode():
        fake, fake_workspaces = training_step(caller_workspace)
    assert fake == real
    assert fake_workspaces == real_workspaces
    layout = gdn_workspace_layout_kcp(build_kcp_context([0, 50, 50, 130]), 2, 4, 16, 16,
                                      options=OptionsKcp(use_qk_l2norm=True))
    if caller_workspace:  # the held arena, tracked for the whole step, is exactly the queried bytes
        assert real["_MemRefType.OTH"] == layout.bytes
        assert real_workspaces == []
    else:  # each call allocates its own arena of its queried figure, in traced code
        assert real_workspaces == [[layout.fwd.bytes], [layout.bwd.bytes]]


@pytest.mark.parametrize("caller_workspace", [False, True])
def test_fake_tensor_memory_of_a_capped_context_is_one_figure_for_every_packing(caller_workspace):
    """MemTracker's peak of a step on a capped context: the fake run equals the
    real one, and two packings (one document, or four with a zero-length one)
    give the same figure."""
    peaks = []
    for bounds in ((0, 130), (0, 7, 7, 64, 130)):
        real, real_workspaces = training_step(caller_workspace, bounds, max_docs=5)
        with FakeTensorMode():
            fake, fake_workspaces = training_step(caller_workspace, bounds, max_docs=5)
        assert fake == real and fake_workspaces == real_workspaces, bounds
        peaks.append((real, real_workspaces))
    assert peaks[0] == peaks[1]


CALL_PATH = ["gdn_kcp/ops", "gdn_kcp/fake", "gdn_kcp/host", "gdn_kcp/exchange", "gdn_kcp/queries",
             "gdn_kcp/workspace.py", "gdn_kcp/kcp.py"]


def test_no_host_sync_on_the_op_call_path():
    """No .item(), .tolist() or .cpu() in what a gdn_kcp call runs (the context
    builder and chunk_gated_delta_rule's FLA-style cu_seqlens read are outside)."""
    pattern = re.compile(r"\.(item|tolist|cpu)\(")
    offenders = []
    for entry in CALL_PATH:
        path = ROOT / entry
        for file in [path] if path.is_file() else sorted(path.rglob("*.py")):
            for number, line in enumerate(file.read_text().splitlines(), 1):
                if pattern.search(line.split("#")[0]):
                    offenders.append(f"{file.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, offenders
