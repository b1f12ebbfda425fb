"""Every python block of README.md runs as written on a CPU machine: each in a
fresh namespace (the two torch.compile blocks in one, as the README says; the
KCP block on two gloo ranks launched the way torchrun launches them)."""

from __future__ import annotations

import re

import torch
from readme_tables import README, options_of, table_rows

from gdn_kcp import OptionsKcp


def python_blocks(section: str) -> list[str]:
    """The ```python blocks of the README section under ``## {section}``."""
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"^```python\n(.*?)^```$", text[start : end if end >= 0 else None], re.S | re.M)


def run_block(section: str) -> dict[str, object]:
    (block,) = python_blocks(section)
    namespace: dict[str, object] = {"__name__": "readme_block"}
    exec(compile(block, f"README.md ## {section}", "exec"), namespace)
    return namespace


def test_api_block():
    ns = run_block("API")
    assert ns["o"].shape == (1, 1000, 4, 128) and ns["final_state"].shape == (3, 4, 128, 128)
    assert ns["v"].grad is not None


def test_byte_query_block():
    """The block runs on the CPU; its workspace is the queried size, its
    backward runs, and its options have a row in the call-figure table."""
    ns = run_block("Byte queries")
    ws, layout, o, v = ns["ws"], ns["layout"], ns["o"], ns["v"]
    assert ws.storage.device.type == "cpu" and ws.nbytes == layout.bytes
    assert o.shape == v.shape and o.dtype == torch.bfloat16 and v.grad is not None
    opts = ns["opts"]
    assert isinstance(opts, OptionsKcp)
    assert opts in [options_of(row[0]) for row in table_rows("call-figures")]


RUN_BLOCKS = {"API": 1, "Byte queries": 1, "Key-context parallelism": 1, "Training with data and context parallelism": 1,
              "torch.compile and CUDA graphs": 3}
"""The blocks the tests here run, per section."""


def test_every_block_is_run():
    sections = re.findall(r"^## (.+)$", README.read_text(), re.M)
    found = {section: len(python_blocks(section)) for section in sections if python_blocks(section)}
    assert found == RUN_BLOCKS


def _kcp_block_on_rank(rank: int, R: int, port: int, block: str, inputs: list, h0, expected) -> None:
    """The KCP block as torchrun would run it: the group comes from the
    environment; its inputs are the whole stream."""
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(R), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    q, k, v, g, beta = inputs
    namespace = dict(q=q, k=k, v=v.clone().requires_grad_(), g=g, beta=beta, h0=h0, HV=v.shape[2], K=q.shape[3],
                     V=v.shape[3], cu_seqlens_global=torch.tensor(BLOCK_BOUNDS))
    try:
        exec(compile(block, "README.md ## Key-context parallelism", "exec"), namespace)
        ctx, o, final_state = namespace["ctx"], namespace["o"], namespace["final_state"]
        start, end = ctx.rank_ranges[rank]
        o_ref, fs_ref = expected
        assert torch.allclose(o, o_ref[:, start:end], rtol=0, atol=1e-10), (o - o_ref[:, start:end]).abs().max()
        assert torch.allclose(final_state, fs_ref[ctx.end_docs], rtol=0, atol=1e-10)
        assert namespace["v"].grad is not None
    finally:
        dist.destroy_process_group()


BLOCK_BOUNDS = [0, 100, 250, 300]


def test_kcp_block_on_two_ranks():
    """The KCP block on 2 gloo ranks: each rank's o and final states are the
    rows of the one-rank call."""
    import socket

    import torch.multiprocessing as mp
    from gdn_inputs import make_inputs

    from gdn_kcp import chunk_gated_delta_rule

    (block,) = python_blocks("Key-context parallelism")
    inputs = make_inputs(300, 1, 2, 16, 16, l2=True)
    h0 = torch.randn(len(BLOCK_BOUNDS) - 1, 2, 16, 16, dtype=torch.float64,
                     generator=torch.Generator().manual_seed(3))
    expected = chunk_gated_delta_rule(*inputs, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor(BLOCK_BOUNDS))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.start_processes(_kcp_block_on_rank, args=(2, port, block, inputs, h0, expected), nprocs=2, join=True,
                       start_method="forkserver")  # the fork server of tests/spawn.py (preloaded once it is imported)


def test_compile_and_memory_blocks():
    """The torch.compile block (a compiled layer, forward and backward) and the
    FakeTensor memory block after it, in one namespace as the README says."""
    blocks = python_blocks("torch.compile and CUDA graphs")[:2]
    namespace: dict[str, object] = {"__name__": "readme_block"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md ## torch.compile and CUDA graphs, block {i + 1}", "exec"), namespace)
    assert namespace["layer"].qkv.weight.grad is not None  # the real layer of block 1 after its backward
    peak = namespace["tracker"].get_tracker_snapshot("peak")
    assert peak  # block 2 traced a training step


def test_training_block_compiles_once():
    """The capped-context training block: three packings through one compiled
    gdn_kcp graph and one held workspace, then the fixed-length flat call: two
    graphs in all, no graph break."""
    from torch._dynamo.utils import counters

    block = python_blocks("torch.compile and CUDA graphs")[2]
    torch._dynamo.reset()
    counters.clear()
    namespace: dict[str, object] = {"__name__": "readme_block"}
    exec(compile(block, "README.md ## torch.compile and CUDA graphs, block 3", "exec"), namespace)
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"], dict(counters["stats"])
    assert len(namespace["steps"]) == 3 and namespace["o"].shape == (1, 512, 4, 32)
    assert namespace["workspace"].ranks_agreed


def _dp_cp_block_on_rank(rank: int, R: int, port: int, block: str) -> None:
    """The data x context parallel block as torchrun would run it (the port
    probed as for the KCP block): its check passes, its step moves every
    parameter away from the seeded initial ones, the loss is finite."""
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(R), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    namespace: dict[str, object] = {"__name__": "readme_block"}
    try:
        exec(compile(block, "README.md ## Training with data and context parallelism", "exec"), namespace)
        assert torch.isfinite(namespace["loss"]).all()
        assert namespace["ctx"].R == 2 and namespace["n_targets"] == 2 * (1024 - 3)
        torch.manual_seed(0)
        initial = namespace["LM"]()
        for (name, trained), fresh in zip(namespace["model"].named_parameters(), initial.parameters()):
            assert not torch.equal(trained.full_tensor(), fresh), name
    finally:
        dist.destroy_process_group()


def test_dp_cp_block_on_four_ranks():
    import socket

    import torch.multiprocessing as mp

    (block,) = python_blocks("Training with data and context parallelism")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.start_processes(_dp_cp_block_on_rank, args=(4, port, block), nprocs=4, join=True, start_method="forkserver")
