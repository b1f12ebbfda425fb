"""The Triton programs under torch.compile, checked without a GPU
(``gdn_kcp.kernels.triton.traced_launches``, in a subprocess: the
interpreter that the other tests run is off there, so Dynamo sees Triton
kernels). torch's analysis of each kernel counts as written exactly the
pointers the kernel stores to (``compile_specs.WRITES``), never an input or
an index table; a traced forward and backward (the FLA-style entry with
every in-kernel option, and ``gdn_kcp`` with two segments and
``save_mode="inverse"``) launches every
program as a ``triton_kernel_wrapper_functional`` that clones only what it
writes, calls no opaque ``gdn_kcp`` op, and writes none of its inputs; and
the peak of Inductor's plan of that step equals the byte queries; and on
every rank of 2 and 3 fake ranks (segments; a2a, ring and overlap in
make test-extended) the peak
of Inductor's plan of ``gdn_kcp`` is within the rank's queries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from gdn_kcp.kernels.triton.compile_specs import WRITES

# the launches of one forward and one backward, by program, in each traced graph
FLA_FORWARD = {"l2_rstd_kernel": 2, "wy_inverse_kernel": 1, "prep_kernel": 1, "scores_kernel": 1,
               "walk_output_kernel": 1}  # light and inverse: the walk with the output
FLA_BACKWARD = {"l2_rstd_kernel": 2, "wy_inverse_kernel": 1, "prep_kernel": 1, "tape_walk_kernel": 1,
                "bwd_local_dv_kernel": 1, "adjoint_walk_kernel": 1, "bwd_dqkwg_kernel": 1, "bwd_wy_kernel": 1,
                "bwd_gate_cumsum_kernel": 1, "bwd_qk_norm_kernel": 2}

SEGMENTS_FORWARD = {**FLA_FORWARD, "segment_summary_kernel": 1, "compose_segments_kernel": 1}
# two segments and save_mode="inverse": the backward reads the saved A and norms (no WY inverse, no l2_rstd)
SEGMENTS_BACKWARD = {**{k: n for k, n in FLA_BACKWARD.items() if k not in ("wy_inverse_kernel", "l2_rstd_kernel")},
                     "segment_summary_kernel": 1, "compose_segments_kernel": 1,
                     "adjoint_segment_summary_kernel": 1, "compose_adjoints_kernel": 1}


# indices into traced_launches.KCP_PLAN_CASES: CI compiles save_transfer with two segments (3 ranks); make
# test-extended the plain a2a and ring at 3 and the replayed boundary with schedule="overlap" (2 ranks)
KCP_CASES = {"ci": (3,), "extended": (0, 1, 2)}


def traced_launches(cache_dir, *args: str) -> dict:
    """The report of ``python -m gdn_kcp.kernels.triton.traced_launches args``."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(cache_dir))
    done = subprocess.run([sys.executable, "-m", "gdn_kcp.kernels.triton.traced_launches", *args], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return traced_launches(tmp_path_factory.mktemp("triton_cache"), "--kcp-cases", ",".join(map(str, KCP_CASES["ci"])))


def test_every_kernel_counts_only_its_outputs_as_written(report):
    """Each configuration's written set lies within the kernel's outputs, and
    over its configurations (the shipped ones and every store on) it is all
    of them: no input or index table counted, no store missed."""
    union: dict[str, set] = {}
    for name, written in report["kernel_writes"].items():
        base = name.split("[")[0]
        assert written, f"{name}: nothing counted as written"
        assert set(written) <= WRITES[base], (name, written)
        union.setdefault(base, set()).update(written)
    assert union == WRITES


def test_traced_step_launches_every_program_and_clones_only_outputs(report):
    graphs = report["graphs"]
    assert [g["graph"] for g in graphs] == ["forward", "backward", "forward", "backward"]
    for g in graphs:
        assert not g["gdn_kcp_ops"], g["gdn_kcp_ops"]
        assert not g["written_inputs"], (g["graph"], g["written_inputs"])
        for launch in g["launches"]:
            assert set(launch["clones"]) <= WRITES[launch["kernel"]], launch
    counts = [Counter(x["kernel"] for x in g["launches"]) for g in graphs]
    assert counts == [FLA_FORWARD, FLA_BACKWARD, SEGMENTS_FORWARD, SEGMENTS_BACKWARD], counts


def test_inductor_plans_the_pools_within_the_queries(report):
    """Inductor's output code for the FLA-style step (Triton programs, captured,
    not run): the programs' kernel launches (FLA_FORWARD and FLA_BACKWARD:
    prep's norms, WY inverse and prep kernel, and so on), no opaque op, and the peak of the
    float buffers it allocates equal to the workspace queries (the forward's
    o is U's pool, which the walk with the output overwrites; the
    backward's gradients go into freed pools); the forward adds only its
    int buffers (the index tables it builds from ``cu_seqlens`` and their
    int64 scratch), the backward none."""
    plan = report["inductor_plan"]
    assert plan["launches"] == [sum(FLA_FORWARD.values()), sum(FLA_BACKWARD.values())], plan["launches"]
    assert plan["gdn_kcp_ops"] == [[], []], plan["gdn_kcp_ops"]
    assert plan["float_peak"] == plan["workspace"], plan
    assert plan["int_peak"][0] >= plan["index_bytes"] and plan["int_peak"][1] == 0, plan
    assert plan["planned_peak"][0] <= plan["workspace"][0] + plan["int_peak"][0], plan
    assert plan["planned_peak"][1] == plan["workspace"][1], plan


def check_kcp_plans(rows: list[dict], cases: tuple[int, ...]) -> None:
    """``gdn_kcp`` on every rank of 2 and 3 ranks (each compiled alone in a
    fake process group; a2a, ring, a replayed boundary with
    ``schedule="overlap"``, save_transfer with two segments): the graphs
    call the exchange ops and no opaque gdn_kcp::fwd / bwd; the backward's
    float buffers peak at most at its workspace (the gradients go into freed
    pools), the forward's at most at its workspace, the saved tensors and o (o is
    U's pool; two segmented ranks still peak up to 16 KB above the first
    two). The backward's float buffers peak within its workspace; beside them
    it holds only int scratch: the segment and crossing tables it derives
    again from the index tables, as the eager backward does (at most 1,176 B
    here, under 2 KB), since the forward hands it the index tables and no
    products of them."""
    from gdn_kcp.kernels.triton.traced_launches import KCP_PLAN_CASES

    assert len(rows) == sum(KCP_PLAN_CASES[i][1] for i in cases), [(r["case"], r["rank"]) for r in rows]
    for row in rows:
        forward, backward = row["planned_peak"]
        for ops in row["gdn_kcp_ops"]:
            assert ops and not [op for op in ops if op.endswith((".fwd", ".bwd"))], row
            assert all(op.split(".")[-1] in ("all_to_all", "all_to_all_start", "all_to_all_issued",
                                             "all_to_all_wait", "send_recv") for op in ops), row
        assert row["float_peak"][1] <= row["workspace"][1], row
        assert backward <= row["workspace"][1] + row["int_peak"][1] and row["int_peak"][1] < 2048, row
        assert forward <= row["workspace"][0] + row["saved_bytes"] + row["o_bytes"], row


def test_inductor_plans_every_kcp_rank_within_the_queries(report):
    check_kcp_plans(report["kcp_plans"], KCP_CASES["ci"])


@pytest.mark.extended
def test_inductor_plans_every_kcp_rank_of_the_plain_exchanges(tmp_path):
    """:func:`check_kcp_plans` for the plain a2a and ring on 3 ranks and the
    replayed boundary with ``schedule="overlap"`` on 2."""
    rows = traced_launches(tmp_path, "--only-kcp", "--kcp-cases", ",".join(map(str, KCP_CASES["extended"])))
    check_kcp_plans(rows["kcp_plans"], KCP_CASES["extended"])


def test_planned_peak_sizes_exchange_outputs_by_dtype():
    """An exchange op's output is counted at its send's dtype (fp32 here, 4
    bytes an element), a buffer freed when its last alias is deleted."""
    from gdn_kcp.kernels.triton.traced_launches import planned_peak

    code = """def call(args):
        buf0 = empty_strided_cuda((1024, ), (1, ), torch.float32)
        buf1 = torch.ops.gdn_kcp.all_to_all.default(reinterpret_tensor(buf0, (1024, ), (1, ), 0), [512, 512], [256, 256], '0', 'c1', [buf0])
        buf2 = buf1
        assert_size_stride(buf2, (512, ), (1, ), 'torch.ops.with_effects')
        del buf1
        del buf0
        buf3 = empty_strided_cuda((100, ), (1, ), torch.bfloat16)
        del buf2
        return (buf3, )
    """
    assert planned_peak(code) == 1024 * 4 + 512 * 4
