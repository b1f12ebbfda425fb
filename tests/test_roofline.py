"""benchmarks/roofline.py, the static H200 estimate: its model on hand-counted
cases, launches of tiny shapes counted by hand, the program sequence it
assumes against the host path's, and the README's figure for ours (from the
README's sm_90 compile table: nothing is compiled here)."""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("roofline", ROOT / "benchmarks" / "roofline.py")
roofline = importlib.util.module_from_spec(_spec)
sys.modules["roofline"] = roofline
_spec.loader.exec_module(roofline)

Launch, Work, H200 = roofline.Launch, roofline.Work, roofline.H200
TENSOR = {"products": "wgmma", "registers": 128, "num_warps": 4, "shared": 0, "spill_stores": 0}  # 4 resident per SM
POOLS = {"A": 2, "w": 2, "v_new": 2, "h": 2, "q_rstd": 4, "k_rstd": 4, "dv_new": 2, "dh": 2, "dq_heads": 2,
         "dk_heads": 2, "dw": 2, "dgcum": 4}  # bytes per element of each pool at bf16 (gdn_kcp.dtypes.buffer_dtype)
TINY = roofline.Shape(T=128, H=1, HV=2, K=16, V=16, NC=2, fragments=1)  # one value tile of 16 per head


def launch_of(launches, kernel, phase="fwd"):
    return next(x for x in launches if x.kernel == kernel and x.phase == phase)


def test_resident_programs_per_sm():
    assert roofline.resident(TENSOR) == 4  # 128 registers x 128 threads: 16,384 of 65,536
    assert roofline.resident(dict(TENSOR, registers=255, num_warps=8)) == 1  # 256 x 256 = 65,536
    assert roofline.resident(dict(TENSOR, registers=32)) == 16  # warps: 64 / 4
    assert roofline.resident(dict(TENSOR, registers=32, shared=100_000)) == 2  # 233,472 // 101,024


def test_time_is_the_largest_term():
    programs = 132 * 4
    launch = Launch("fwd", "k", programs, Work(bf16=H200.bf16 * 2e-3 / programs, bytes=H200.hbm * 1e-3 / programs))
    t = roofline.terms(launch, TENSOR)
    assert t["compute"] == pytest.approx(2e-3) and t["memory"] == pytest.approx(1e-3) and t["serial"] == 0
    assert t["time"] == t["compute"]
    on_fma = roofline.terms(launch, dict(TENSOR, products="fma"))  # no tensor cores: the fp32 peak
    assert on_fma["compute"] == pytest.approx(2e-3 * H200.bf16 / H200.fp32) == on_fma["time"]
    # two waves of 4 x 132 programs, 3 dependent steps of 1 ms each: 6 ms
    chain = Launch("fwd", "k", 2 * programs, Work(fp32=3.0), steps=3, step=Work(fp32=1.0))
    t = roofline.terms(chain, TENSOR, replace(H200, step_latency=1e-3))
    assert t["waves"] == 2 and t["serial"] == pytest.approx(6e-3, rel=1e-6) and t["time"] == t["serial"]
    torch_op = roofline.terms(Launch("bwd", None, 1, Work(bytes=H200.hbm * 1e-3)), None)
    assert torch_op["time"] == pytest.approx(1e-3)


def test_few_programs_use_a_share_of_the_peaks():
    work = Work(bf16=1e9, bytes=1e6)
    for programs in (64, 132, 264):
        t = roofline.terms(Launch("fwd", "k", programs, work), TENSOR)
        ideal = programs * work.bf16 / H200.bf16
        assert t["compute"] == pytest.approx(ideal * 132 / min(programs, 132))


def test_walk_latency_falls_with_fragments_and_rises_with_step_latency():
    latency_bound = replace(H200, step_latency=10e-6)
    shape = replace(TINY, T=64 * 512, NC=512)

    def serial(fragments, machine):
        walk = launch_of(roofline.our_launches(replace(shape, fragments=fragments), POOLS), "tape_walk_kernel")
        return roofline.terms(walk, TENSOR, machine)["serial"]

    assert serial(2, latency_bound) == pytest.approx(serial(1, latency_bound) / 2)  # half the steps, 4 programs
    assert serial(1, latency_bound) > serial(1, H200) > serial(1, replace(H200, step_latency=0.1e-6))
    # 64 programs x 512 steps, each moving its bytes at 1/64 of the HBM: memory-bound once latency is small
    walk = launch_of(roofline.our_launches(roofline.Shape(), POOLS), "tape_walk_kernel")
    t = roofline.terms(walk, dict(TENSOR, registers=255, num_warps=8), replace(H200, step_latency=0.1e-6))
    assert walk.programs == 64 and t["serial"] == pytest.approx(walk.work.bytes * 64 / H200.hbm) == t["memory"]


def test_our_launches_counted_by_hand():
    launches = roofline.our_launches(TINY, POOLS)
    output = launch_of(launches, "output_kernel")
    assert output.programs == 4  # 2 chunks x 2 heads x 1 value tile
    assert output.work == Work(bf16=131072 + 32768 + 131072,  # QK^T 2*64*64*16, Q S0 2*64*16*16, P Vn 2*64*64*16
                               bytes=4096 + 512 + 128 + 512 + 2048 + 2048)  # q k, their norms, g, h, v_new, o
    walk = launch_of(launches, "tape_walk_kernel")
    assert (walk.programs, walk.steps) == (2, 2) and walk.work == walk.step * 2
    assert walk.step == Work(bf16=65536, bytes=2048 + 256 + 128 + 2048 + 4096 + 512)  # k, k_rstd, g, w, u + v_new, h
    prep_fwd, prep_bwd = launch_of(launches, "prep_kernel"), launch_of(launches, "prep_kernel", "bwd")
    assert prep_bwd.work.bytes - prep_fwd.work.bytes == 64 * 64 * 2  # only the backward's recompute writes A
    assert prep_fwd.steps == 15 and prep_fwd.step == Work(fp32=6 * 64 * 64)  # 16-row diagonal blocks, packed
    norms = [x for x in launches if x.kernel == "l2_rstd_kernel"]
    assert len(norms) == 4 and norms[0].programs == 2 and norms[0].work.bytes == 64 * 16 * 2 + 64 * 4
    assert sum(x.kernel == "bwd_qk_norm_kernel" for x in launches) == 2


def test_bytes_follow_the_pool_dtypes():
    shape = roofline.Shape()
    fp32_w, bf16_w = roofline.our_launches(shape, dict(POOLS, w=4)), roofline.our_launches(shape, POOLS)
    extra = launch_of(fp32_w, "tape_walk_kernel").work.bytes - launch_of(bf16_w, "tape_walk_kernel").work.bytes
    assert extra == shape.NC * shape.C * shape.K * 2  # w read once per chunk, 2 more bytes an element


def test_fla_launches_counted_by_hand():
    shape = replace(TINY, K=64, V=64)
    launches = roofline.fla_launches(shape)
    output = launch_of(launches, "chunk_fwd_kernel_o")
    assert output.programs == 4 and output.work == Work(bf16=3 * 524288,  # QK^T, Q h, A v: 2*64*64*64 each
                                                        bytes=16384 + 8192 + 256 + 16384)  # q k, h, g, v o
    kkt = launch_of(launches, "chunk_gated_delta_rule_fwd_kkt_solve_kernel")
    assert kkt.steps == 56 and kkt.work.tf32 == 16 * 2 * 16**3  # 4 blocks x 14 rows; 16 [16, 16] products
    assert len(launches) == 8 + 16 and sum(x.kernel is None for x in launches) == 8  # torch ops: bytes only


def test_the_same_math_counts_the_same_flops():
    ours, fla = roofline.our_launches(roofline.Shape(), POOLS), roofline.fla_launches(roofline.Shape())

    def flops(launches, kernel, phase="bwd"):
        x = launch_of(launches, kernel, phase)
        return x.programs * x.work.bf16

    assert flops(ours, "bwd_wy_kernel") == flops(fla, "prepare_wy_repr_bwd_kernel")
    assert flops(ours, "output_kernel", "fwd") == flops(fla, "chunk_fwd_kernel_o", "fwd")
    assert flops(ours, "tape_walk_kernel") == flops(fla, "chunk_gated_delta_rule_fwd_kernel_h_blockdim64")
    assert flops(ours, "adjoint_walk_kernel") == flops(fla, "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64")


def test_program_sequence_is_the_host_paths(monkeypatch):
    """OUR_PROGRAMS against the torch programs one forward+backward calls (one
    rank, one document, the L2 norm, default options); prep writes A in the
    backward only."""
    from gdn_kcp.kernels import torch as programs

    from gdn_kcp import build_kcp_context, gdn_kcp

    calls = []

    def recorded(name, program):
        def record(*args, **kwargs):
            calls.append((name, kwargs.get("A_out") is not None))
            return program(*args, **kwargs)
        return record

    for name in programs.__all__:
        monkeypatch.setattr(programs, name, recorded(name, getattr(programs, name)))
    T, gen = 130, torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, T, 1, 16, generator=gen).requires_grad_() for _ in range(2))
    v = torch.randn(1, T, 2, 16, generator=gen).requires_grad_()
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, 2, generator=gen)).requires_grad_()
    beta = torch.rand(1, T, 2, generator=gen).requires_grad_()
    o, _ = gdn_kcp(q, k, v, g, beta, build_kcp_context([0, T]), use_qk_l2norm_in_kernel=True)
    forward = len(calls)
    o.sum().backward()
    assert [name for name, _ in calls[:forward]] == list(roofline.OUR_PROGRAMS["fwd"])
    assert [name for name, _ in calls[forward:]] == list(roofline.OUR_PROGRAMS["bwd"])
    assert [a for name, a in calls if name == "prep"] == [False, True]


def test_readme_states_our_estimate():
    """The README's figure for ours is the script's at the README's sm_90 compile
    facts (tests/test_triton_compile.py ties those to the compile)."""
    from readme_tables import README
    from test_triton_compile import readme_kernel_table

    table = readme_kernel_table()
    if table is None:
        pytest.skip("the README's compile table is another triton's")
    facts = {name: {"products": p, "registers": r, "spill_stores": s, "shared": sh, "num_warps": w}
             for name, (p, r, s, sh, w) in table.items()}
    result = roofline.our_estimate(facts)
    pattern = r"ours\s+([\d.]+)\s+ms\s+\(forward\s+([\d.]+),\s+backward\s+([\d.]+)"
    stated = re.search(pattern, README.read_text())
    assert stated, "README: no 'ours X ms (forward Y, backward Z' in the roofline section"
    computed = tuple(f"{result[key]:.2f}" for key in ("total_ms", "forward_ms", "backward_ms"))
    assert stated.groups() == computed, f"README states {stated.groups()}, `make roofline` gives {computed}"


def test_gpu_check_rates_and_ratios_come_from_the_model():
    """gpu_check's achieved TFLOP/s divide the model's FLOPs of a kernel by its
    measured time; its per-kernel ratio sums FLA's counterparts of ours."""
    sys.modules.setdefault("roofline", roofline)
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    from gdn_kcp import build_kcp_context

    ctx = build_kcp_context([0, 70, 200])
    dims = (1, 2, 32, 32)
    shape = roofline.shape_of(ctx, *dims)
    assert (shape.T, shape.NC, shape.fragments) == (200, 2 + 3, 2)  # chunks cut at each document start
    elements = roofline.pool_element_sizes(ctx, shape, roofline.OptionsKcp(use_qk_l2norm=True))
    prep = roofline.kernel_flops(roofline.our_launches(shape, elements))["prep_kernel"]
    assert prep == sum(x.programs * x.work.flops for x in roofline.our_launches(shape, elements)
                       if x.kernel == "prep_kernel") > 0
    rates = gpu_check.achieved_tflops({"gdn_kcp": {"prep_kernel": 2.0, "aten::mm": 1.0}}, ctx, dims)
    assert rates == {"gdn_kcp": {"prep_kernel": round(prep / 2e-3 / 1e12, 2)}}
    fla = dict.fromkeys(roofline.COUNTERPARTS["prep_kernel"], 1.0)
    assert gpu_check.counterpart_ratios({"prep_kernel": 2.0, "output_kernel": 1.0}, fla) == {
        "prep_kernel": len(fla) / 2.0}  # output's counterpart was not profiled


def test_walk_latency_over_segments():
    """The forward walk at P segments (full shape, hand-made compile facts of
    two walk programs per SM, as today's walks: 255 registers x 4 warps): at
    HV = 32 the tape walk is HBM-bound and every P > 1 is slower; at HV = 4
    (8 programs, each bound by its SM's bandwidth) the latency falls with P, to
    about half at the plan's P = 5, which is also the estimate's best. With no
    bandwidth limit at all (each step its latency and its tensor work at one
    SM's rates) P = 1 stays the best at HV = 32: segments triple the walk's
    program-steps (phase 1 folds V + K columns, phase 3 walks again) while the
    idle SMs add at most 132 / 64 of tensor throughput."""
    from gdn_kcp.context import context_from_split
    from gdn_kcp.plan import plan_segments

    two = dict(TENSOR, registers=255, num_warps=4)
    assert roofline.resident(two) == 2
    facts = {name: two for name in roofline.WALK_KERNELS}
    table = {row["P"]: row for row in roofline.walk_latency_table(facts, Ps=range(1, 9))}
    assert all(table[P]["HV=32"] > table[1]["HV=32"] for P in range(2, 9))
    assert table[5]["HV=4"] < table[4]["HV=4"] < table[3]["HV=4"] < table[1]["HV=4"] / 1.4
    ctx = context_from_split([0, 32768], [(0, 32768)], 0, n_sms=132)
    assert min(table, key=lambda P: table[P]["HV=4"]) == plan_segments(ctx, 4, 128, 128) == 5
    assert plan_segments(ctx, 32, 128, 128) == 1
    assert table[1]["HV=32"] == pytest.approx(512 * 65920 * 64 / 4.8e12 * 1e6)  # the plan's model: 450 us
    alone = {P: row[roofline.STEPS_ALONE] for P, row in table.items()}
    assert min(alone, key=alone.get) == 1 and alone[1] < table[1]["HV=32"] / 1.5
    # P = 1 is the tape walk alone: 64 programs of 512 steps
    (tape,) = roofline.segment_walk_launches(roofline.Shape(), {"k_rstd": 4, "w": 2, "v_new": 2, "h": 2}, 1)
    assert (tape.kernel, tape.programs, tape.steps) == ("tape_walk_kernel", 64, 512)
    summary, compose, walk = roofline.segment_walk_launches(
        roofline.Shape(), {"k_rstd": 4, "w": 2, "v_new": 2, "h": 2, "seg_summary": 4}, 4)
    assert (summary.programs, summary.steps) == (4 * 32 * 4, 128)  # P HV (V + K) / 64 tiles, n / P steps
    assert (compose.programs, compose.steps) == (32 * 128 // 16, 4)  # value tiles of 16
    assert (walk.programs, walk.steps) == (4 * 32 * 2, 128)
