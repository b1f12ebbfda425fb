"""The CuTe DSL programs compiled for sm_90a on the CPU (fake tensors, no
driver): wgmma for every product in the PTX and HGMMA in the SASS, no spill,
docs/cute.md's register table, and the host wrapper's launch against the twin's
buffers. Skipped where nvidia-cutlass-dsl is not installed. Eight compiles,
about 15 s on two cores."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

cute = pytest.importorskip("cutlass.cute")

from doc_tables import table_rows  # noqa: E402

from gdn_kcp.host.programs import load_programs, use_programs  # noqa: E402
from gdn_kcp.kernels import CHUNK_SIZE, ChunkIndex  # noqa: E402
from gdn_kcp.kernels.cute import compile_facts as facts_module  # noqa: E402
from gdn_kcp.kernels.cute.launch import fake_arguments  # noqa: E402
from gdn_kcp.kernels.twin_check import CaseSetup  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "cute.md"
CUTE_SCORES = importlib.import_module("gdn_kcp.kernels.cute.scores")
CUTE_PREP = importlib.import_module("gdn_kcp.kernels.cute.w_u")


@pytest.fixture(scope="module")
def facts():
    return {case: facts_module.compile_facts(*case) for case in facts_module.CHECKED_CASES}


def products(program: str, D: int) -> int:
    """wgmma instructions a program issues: one per 16 of each product's depth
    (scores: Q K^T over K; w_u: W and U, each over the chunk's 64 rows)."""
    return D // 16 if program == "scores" else 2 * CHUNK_SIZE // 16


def test_every_product_is_a_wgmma(facts):
    for (program, dtype, D), f in facts.items():
        n = CHUNK_SIZE if program == "scores" else D
        kind = "bf16" if dtype == torch.bfloat16 else "f16"
        assert f.wgmma == (f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind}",), (program, dtype, D)
        assert f.wgmma_count == products(program, D), (program, dtype, D)
        if f.hgmma_count is not None:  # cuobjdump present: the SASS runs them on the tensor cores
            assert f.hgmma_count == f.wgmma_count, (program, dtype, D)


def test_no_spill(facts):
    for case, f in facts.items():
        assert f.registers > 0 and f.local_bytes == 0 and f.stack_bytes == 0, (case, f)


def cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def test_docs_table_holds_the_compiled_facts(facts):
    documented = re.search(r"from nvidia-cutlass-dsl (\d+\.\d+\.\d+)", " ".join(DOC.read_text().split())).group(1)
    installed = importlib.metadata.version("nvidia-cutlass-dsl")
    if installed != documented:
        pytest.skip(f"the table is of nvidia-cutlass-dsl {documented}, {installed} is installed")
    rows = [row for row in table_rows("cute-compile-table") if row[0] != "program"]
    assert sorted(rows) == sorted(cells(facts_module.table_row(f)) for f in facts.values())


def twin_buffers(dtype: torch.dtype, K: int):
    """The twin check's inputs and buffers on the meta device (its shapes and pool dtypes)."""
    H_qk, HV, bounds = 2, 4, (0, 70, 200)
    case = CaseSetup(bounds, H_qk, HV, K, K, dtype, seed=0, l2=True, crossing=True, device="meta", capped=False)
    T = case.T
    buffers = dict(rstd=case.new(T, H_qk), A=case.new(T, HV, CHUNK_SIZE, pool="A"), w=case.new(T, HV, K, pool="w"),
                   u=case.new(T, HV, K, pool="v_new"), scores=case.new(T, HV, CHUNK_SIZE, pool="scores"))
    return case, buffers


def assert_fakes_match(launch) -> None:
    """Each fake tensor has its buffer's dtype width, shape and strides, with T (or the chunk count) symbolic."""
    for name, x, fake, dim in zip(launch.names, launch.tensors, fake_arguments(launch), launch.symbolic):
        assert fake.element_type.width == x.element_size() * 8, name
        for d, (n, s) in enumerate(zip(x.shape, x.stride())):
            if d == dim:
                assert not isinstance(fake.shape[d], int), name
            else:
                assert fake.shape[d] == n, name
            if isinstance(fake.stride[d], int):
                assert fake.stride[d] == s, name
            else:  # symbolic stride: the dims after it include the symbolic one
                assert dim is not None and dim > d, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [128, 64])
def test_launch_matches_the_twin_buffers(dtype, K):
    case, b = twin_buffers(dtype, K)
    H_qk, HV = case.q.shape[1], case.v.shape[1]
    launch = CUTE_SCORES.plan(case.q, case.k, case.g, case.index, q_rstd=b["rstd"], k_rstd=b["rstd"],
                              scores_out=b["scores"])
    assert launch.grid == (case.index.n_chunks, H_qk, 1)  # the Triton program's: one per chunk and key head
    assert_fakes_match(launch)
    launch = CUTE_PREP.plan(case.k, case.v, case.g, case.beta, b["A"], case.index, k_rstd=b["rstd"],
                            w_out=b["w"], u_out=b["u"])
    assert launch.grid == (case.index.n_chunks, HV, 1)  # one per chunk and value head
    assert_fakes_match(launch)


def test_calls_without_a_cute_program_are_not_covered():
    case, b = twin_buffers(torch.bfloat16, 128)
    assert CUTE_SCORES.covered(case.q, b["scores"]) and CUTE_PREP.covered(case.k, case.v, b["A"])
    fp32 = case.q.float()
    assert not CUTE_SCORES.covered(fp32, b["scores"].float())
    assert not CUTE_PREP.covered(case.k, case.v, b["A"].float())
    assert not CUTE_SCORES.covered(case.q[..., :100], b["scores"])


def test_a_strided_buffer_is_refused_by_name():
    case, b = twin_buffers(torch.bfloat16, 128)
    launch = CUTE_SCORES.plan(case.q, case.k, case.g, case.index, q_rstd=None, k_rstd=None, scores_out=b["scores"])
    strided = dataclasses.replace(launch, tensors=(case.q.transpose(0, 1), *launch.tensors[1:]))
    with pytest.raises(ValueError, match="^q must be contiguous"):
        fake_arguments(strided)


def test_use_programs_cute_takes_cute_where_it_exists():
    import gdn_kcp.kernels.cute as cute_programs
    import gdn_kcp.kernels.triton as triton_programs

    assert load_programs("cuda") is triton_programs  # the default
    with use_programs("cuda", "cute"):
        assert load_programs("cuda") is cute_programs
    assert load_programs("cuda") is triton_programs
    for name in triton_programs.__all__:
        owner = getattr(cute_programs, name).__module__
        expected = "gdn_kcp.kernels.cute" if name in cute_programs.CUTE_PROGRAMS else "gdn_kcp.kernels.triton"
        assert owner.startswith(expected), (name, owner)
    with pytest.raises(ValueError, match="device_type"):
        with use_programs("cpu", "cute"):
            pass


def test_the_package_does_not_import_the_dsl():
    code = ("import sys, gdn_kcp, gdn_kcp.kernels.triton, gdn_kcp.host.programs; "
            "sys.exit('cutlass' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def layout_text(t) -> str:
    """``(shape),(stride)`` of a fake or runtime DSL tensor, symbolic entries as ``?``."""
    text = str(t.type if hasattr(t, "type") else t)
    text = re.sub(r"\{[^}]*\}", "", text).replace(" ", "").replace("):(", "),(")
    return re.search(r"\(([^()]*)\),\(([^()]*)\)", text).group(0)


def test_runtime_tensors_have_the_compiled_layouts():
    """What a GPU call passes (``from_dlpack``, symbolic dims marked dynamic) has
    the dtypes, shapes and strides the program was compiled against."""
    from gdn_kcp.kernels.cute.launch import runtime_arguments

    case, b = twin_buffers(torch.bfloat16, 64)
    real = {name: torch.zeros(x.shape, dtype=x.dtype) for name, x in b.items()}
    inputs = [torch.zeros(x.shape, dtype=x.dtype) for x in (case.q, case.k, case.v, case.g, case.beta)]
    q, k, v, g, beta = inputs
    index = ChunkIndex.from_fragments([0, 70, case.T])  # the twin case's fragments, on the CPU
    launches = [CUTE_SCORES.plan(q, k, g, index, q_rstd=real["rstd"], k_rstd=real["rstd"], scores_out=real["scores"]),
                CUTE_PREP.plan(k, v, g, beta, real["A"], index, k_rstd=real["rstd"], w_out=real["w"],
                               u_out=real["u"])]
    for launch in launches:
        for name, fake, runtime in zip(launch.names, fake_arguments(launch), runtime_arguments(launch)):
            assert runtime.element_type == fake.element_type, name
            assert layout_text(runtime) == layout_text(fake), name
