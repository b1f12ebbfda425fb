"""Every python block of README.md and docs/*.md runs as written on a CPU
machine: each in a fresh namespace (the two blocks of docs/compile.md in one,
as that page says), the KCP blocks on two gloo ranks and the dp x cp block on
four, launched the way torchrun launches them."""

from __future__ import annotations

import pytest
import torch
from doc_blocks import block_namespace, every_block, python_blocks, run_block
from doc_tables import options_of, table_rows

from gdn_kcp import OptionsKcp

RUN_BLOCKS = {
    ("README.md", "The FLA-style call"): 1,
    ("README.md", "Key-context parallelism"): 1,
    ("README.md", "The layer"): 2,
    ("README.md", "Compile and capture"): 1,
    ("README.md", "Byte queries"): 1,
    ("README.md", "transformers' models"): 1,
    ("docs/bytes.md", "Byte queries"): 1,
    ("docs/api.md", "KDA: chunk_kda, kda_kcp and naive_kda_recurrence"): 1,
    ("docs/api.md", "transformers' models: gdn_kcp.integrations.transformers"): 1,
    ("docs/api.md", "Key-context parallelism in transformers' models"): 1,
    ("docs/compile.md", "torch.compile and CUDA graphs"): 2,
    ("docs/compile.md", "Lowering: the traced host path"): 1,  # tests/test_inductor_lowering.py
    ("docs/compile.md", "Activation checkpointing under torch.compile"): 1,
    ("docs/kcp.md", "A KCP call with states"): 1,
    ("docs/kcp.md", "Training with data and context parallelism"): 1,
}
"""The blocks the tests here run, per (file, heading): a new block fails
test_every_block_is_run until a test runs it."""

KCP_BLOCKS = [("README.md", "Key-context parallelism"), ("docs/kcp.md", "A KCP call with states")]


def test_every_block_is_run():
    assert every_block() == RUN_BLOCKS


def test_fla_call_block():
    ns = run_block("README.md", "The FLA-style call")
    assert ns["o"].shape == (1, 1000, 4, 128) and ns["final_state"].shape == (3, 4, 128, 128)
    assert ns["v"].grad is not None


def test_kda_block():
    ns = run_block("docs/api.md", "KDA: chunk_kda, kda_kcp and naive_kda_recurrence")
    assert ns["o"].shape == (1, 100, 4, 64) and ns["s"].shape == (2, 4, 64, 64)
    assert torch.isfinite(ns["o"]).all()


def test_transformers_block():
    """A packed training step of transformers' Qwen3-Next on gdn_kcp's ops;
    the block restores transformers' ops when it ends."""
    pytest.importorskip("transformers")
    from gdn_kcp.integrations.transformers import is_patched

    ns = run_block("docs/api.md", "transformers' models: gdn_kcp.integrations.transformers")
    assert torch.isfinite(ns["loss"])
    assert all(p.grad is not None for p in ns["model"].model.layers[0].linear_attn.parameters())
    assert not is_patched("qwen3_next")


def test_readme_transformers_block():
    """The README's packed training step of transformers' OLMo-Hybrid on
    gdn_kcp's ops: a finite loss, a gradient in every parameter of the
    linear-attention layer, transformers' ops back after the block."""
    pytest.importorskip("transformers")
    from gdn_kcp.integrations.transformers import is_patched

    ns = run_block("README.md", "transformers' models")
    assert torch.isfinite(ns["loss"])
    assert all(p.grad is not None for p in ns["model"].model.layers[0].linear_attn.parameters())
    assert not is_patched("olmo_hybrid")


def _transformers_kcp_block_on_rank(rank: int, R: int, port: int) -> None:
    """The transformers KCP block as torchrun would run it: the losses summed
    over the ranks are the one-rank loss of the packed stream (fp32), and
    every linear-attention parameter has the same summed gradient on every rank."""
    import os

    import torch.distributed as dist

    from gdn_kcp.integrations.transformers import use_gdn_kcp

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(R), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        ns = run_block("docs/api.md", "Key-context parallelism in transformers' models")
        assert ns["ctx"].R == R
        model, ids, shift, bounds = ns["model"], ns["ids"], ns["shift_labels"], ns["bounds"]
        cu = torch.tensor(bounds, dtype=torch.int32)
        total = ns["loss"].detach().clone()
        dist.all_reduce(total)
        with torch.no_grad(), use_gdn_kcp():
            one = model(ids, labels=shift, shift_labels=shift, num_items_in_batch=int((shift != -100).sum()),
                        use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=300,
                        max_length_k=300).loss
        torch.testing.assert_close(total, one, rtol=1e-5, atol=0)
        for p in model.model.layers[0].linear_attn.parameters():
            gathered = [torch.empty_like(p.grad) for _ in range(R)]
            dist.all_gather(gathered, p.grad)
            assert all(torch.equal(g, p.grad) for g in gathered)
    finally:
        dist.destroy_process_group()


def test_transformers_kcp_block_on_two_ranks():
    pytest.importorskip("transformers")
    import torch.multiprocessing as mp

    mp.start_processes(_transformers_kcp_block_on_rank, args=(2, _free_port()), nprocs=2, join=True,
                       start_method="forkserver")


def test_layer_block():
    ns = run_block("README.md", "The layer")
    assert ns["o"].shape == (1, 1000, 64)
    assert all(p.grad is not None for p in ns["layer"].parameters())


def test_layer_decode_block():
    ns = run_block("README.md", "The layer", 1)
    assert ns["o"].shape == (2, 40, 64) and ns["step"].shape == (2, 1, 64)
    assert ns["cache"].get_seq_length() == 41 and ns["cache"][0]["recurrent_state"].shape == (2, 2, 16, 32)


def test_readme_byte_query_block():
    """The README's queries answer for rank 1 of 4 with no group: its range
    [8192, 16384) ends the first document and starts the second, so it
    receives a state in c2 and sends a summary in c1."""
    ns = run_block("README.md", "Byte queries")
    ctx, layout, comm = ns["ctx"], ns["layout"], ns["comm"]
    assert (ctx.R, ctx.rank, ctx.group) == (4, 1, None) and (ctx.n_in, ctx.n_out, ctx.rank_middle[1]) == (1, 1, 0)
    assert layout.bytes == max(layout.fwd.bytes, layout.bwd.bytes) > 0 and ns["saved"] > 0
    assert comm["c1"]["send"] > 0 and comm["c2"]["recv"] > 0


def test_byte_query_block():
    """The block runs on the CPU; its workspace is the queried size, its
    backward runs, and its options have a row in the call-figure table."""
    ns = run_block("docs/bytes.md", "Byte queries")
    ws, layout, o, v = ns["ws"], ns["layout"], ns["o"], ns["v"]
    assert ws.storage.device.type == "cpu" and ws.nbytes == layout.bytes
    assert o.shape == v.shape and o.dtype == torch.bfloat16 and v.grad is not None
    opts = ns["opts"]
    assert isinstance(opts, OptionsKcp)
    assert opts in [options_of(row[0]) for row in table_rows("call-figures")]


def _kcp_block_on_rank(rank: int, R: int, port: int, file: str, heading: str) -> None:
    """A KCP block as torchrun would run it: the group comes from the
    environment; the block makes the whole stream itself. Its rows of o (and
    of the final states, when it asks for them) are those of the one-rank call
    on the same stream, and its backward reaches v."""
    import os

    import torch.distributed as dist

    from gdn_kcp import chunk_gated_delta_rule

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(R), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        ns = run_block(file, heading)
        ctx, o = ns["ctx"], ns["o"]
        start, end = ctx.rank_ranges[rank]
        assert ctx.R == R and end > start
        inputs = [ns[name].detach() for name in ("q", "k", "v", "g", "beta")]
        states = "final_state" in ns and ns["final_state"] is not None
        o_ref, fs_ref = chunk_gated_delta_rule(*inputs, cu_seqlens=ns["cu_seqlens_global"],
                                               use_qk_l2norm_in_kernel=True, output_final_state=states,
                                               initial_state=ns["h0"] if states else None)
        # fp32: a crossing document is chunked from each rank's boundary and its start state composed
        # from (M, S_loc), so the rows agree with the one-rank call to rounding, not bitwise
        torch.testing.assert_close(o, o_ref[:, start:end], rtol=1e-4, atol=1e-5)
        if states:
            torch.testing.assert_close(ns["final_state"], fs_ref[ctx.end_docs], rtol=1e-4, atol=1e-5)
        assert ns["v"].grad is not None
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("file, heading", KCP_BLOCKS, ids=[file for file, _ in KCP_BLOCKS])
def test_kcp_block_on_two_ranks(file, heading):
    import torch.multiprocessing as mp

    mp.start_processes(_kcp_block_on_rank, args=(2, _free_port(), file, heading), nprocs=2, join=True,
                       start_method="forkserver")  # the fork server of tests/spawn.py (preloaded once it is imported)


def test_compile_and_memory_blocks():
    """The torch.compile block (a compiled layer, forward and backward) and the
    FakeTensor memory block after it, in one namespace as docs/compile.md says."""
    namespace = block_namespace()
    for index in range(2):
        run_block("docs/compile.md", "torch.compile and CUDA graphs", index, namespace)
    assert namespace["layer"].qkv.weight.grad is not None  # the real layer of block 1 after its backward
    peak = namespace["tracker"].get_tracker_snapshot("peak")
    assert peak  # block 2 traced a training step


def test_training_block_compiles_once():
    """The capped-context training block: three packings through one compiled
    gdn_kcp graph and one held workspace, then the fixed-length flat call: two
    graphs in all, no graph break."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    namespace = run_block("README.md", "Compile and capture")
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"], dict(counters["stats"])
    assert len(namespace["steps"]) == 3 and namespace["o"].shape == (1, 512, 4, 32)
    assert namespace["workspace"].ranks_agreed


def _dp_cp_block_on_rank(rank: int, R: int, port: int) -> None:
    """The data x context parallel block as torchrun would run it (the port
    probed as for the KCP blocks): its check passes, its step moves every
    parameter away from the seeded initial ones, the loss is finite."""
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(R), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        namespace = run_block("docs/kcp.md", "Training with data and context parallelism")
        assert torch.isfinite(namespace["loss"]).all()
        assert namespace["ctx"].R == 2 and namespace["n_targets"] == 2 * (1024 - 3)
        torch.manual_seed(0)
        initial = namespace["LM"]()
        for (name, trained), fresh in zip(namespace["model"].named_parameters(), initial.parameters()):
            assert not torch.equal(trained.full_tensor(), fresh), name
    finally:
        dist.destroy_process_group()


def test_dp_cp_block_on_four_ranks():
    import torch.multiprocessing as mp

    assert len(python_blocks("docs/kcp.md", "Training with data and context parallelism")) == 1
    mp.start_processes(_dp_cp_block_on_rank, args=(4, _free_port()), nprocs=4, join=True, start_method="forkserver")


def test_selective_checkpoint_block():
    ns = run_block("docs/compile.md", "Activation checkpointing under torch.compile")
    assert ns["x"].grad is not None and ns["proj"].weight.grad is not None
