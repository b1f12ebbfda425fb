"""Every Triton kernel, at its shipped configuration for K = V = 128 and bf16
inputs, compiles for Hopper (sm_90) without a GPU: within the H100/H200
shared-memory limit, every kernel with a ``tl.dot`` on tensor cores (``wgmma``
or ``mma`` in its PTX) but the exact compositions of segments (scalar fp32
FMA, on purpose), and spill stores per thread (ptxas's log) at most 1 KiB.
sm_100 too where
the installed Triton has that target. The compile runs in a fresh process, with
a fresh ``TRITON_CACHE_DIR`` (so ptxas runs) and the interpreter off."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SHARED_MEMORY_LIMIT = 232_448  # bytes of dynamic shared memory per block, H100 / H200


SPILL_LIMIT = 1024
EXACT_PRODUCTS = {"compose_segments_kernel", "compose_segments_kernel[M]", "compose_adjoints_kernel"}
"""Kernels whose ``tl.dot`` is exact fp32 (``input_precision="ieee"``), so not on
tensor cores: the compositions of segments multiply states and M, which stay
fp32 (docs/design.md, "Precision": every M and every state that crosses a boundary), never
rounded to bf16 or tf32 operands."""
WITH_PRODUCTS = {"wy_inverse_kernel", "prep_kernel", "tape_walk_kernel", "summary_walk_kernel", "summary_walk_kernel[M]",
                 "output_kernel", "scores_kernel", "channel_scores_kernel", "channel_wy_inverse_kernel",
                 "prep_kernel[channel]", "tape_walk_kernel[channel]", "walk_output_kernel",
                 "walk_output_kernel[channel]", "summary_walk_kernel[channel]", "summary_walk_kernel[M channel]",
                 "output_kernel[channel]", "bwd_local_dv_kernel",
                 "bwd_local_dv_kernel[one head]", "bwd_local_dv_kernel[channel]", "adjoint_walk_kernel",
                 "adjoint_walk_kernel[channel]", "adjoint_summary_kernel", "adjoint_summary_kernel[channel]",
                 "bwd_dqkwg_kernel", "bwd_dqkwg_kernel[channel]", "bwd_wy_kernel", "bwd_wy_kernel[channel]",
                 "segment_summary_kernel", "segment_summary_kernel[channel]", "adjoint_segment_summary_kernel",
                 "adjoint_segment_summary_kernel[channel]"} | EXACT_PRODUCTS
N_KERNELS = 47
DECODE_KERNELS = "recurrent_kernel,recurrent_kernel[conv],recurrent_kernel[channel],conv_step_kernel"


def compile_kernels(arch: int, tmp_path, report: bool = False, *args: str) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "gdn_kcp.kernels.triton.compile_specs", "--arch", str(arch),
         *(["--report"] if report else []), *args],
        env=env, capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_every_kernel_compiles_for_sm90_on_tensor_cores_within_shared_memory_and_spills(tmp_path):
    from gdn_kcp.kernels.triton.compile_specs import SHARED_MEMORY_LIMIT as shipped_limit
    from gdn_kcp.kernels.triton.compile_specs import markdown

    assert shipped_limit == SHARED_MEMORY_LIMIT
    rows = compile_kernels(90, tmp_path, report=True)
    assert len(rows) == N_KERNELS
    print("\n" + markdown(rows))
    over = [r for r in rows if r["shared"] > SHARED_MEMORY_LIMIT]
    assert not over, over
    assert {r["kernel"] for r in rows if r["products"] != "-"} == WITH_PRODUCTS
    not_on_tensor_cores = [r["kernel"] for r in rows
                           if r["products"] not in ("-", "wgmma", "mma") and r["kernel"] not in EXACT_PRODUCTS]
    assert not not_on_tensor_cores, not_on_tensor_cores
    assert {r["kernel"]: r["products"] for r in rows if r["kernel"] in EXACT_PRODUCTS} == dict.fromkeys(
        EXACT_PRODUCTS, "fma")
    spilling = {r["kernel"]: r["spill_stores"] for r in rows if r["spill_stores"] > SPILL_LIMIT}
    assert not spilling, spilling
    assert all(r["registers"] > 0 for r in rows), rows  # ptxas ran for every kernel (its log was read)
    stated_rows = stated_kernel_table()
    if stated_rows is not None:  # docs/cuda.md's table states these figures (its triton's ptxas)
        assert stated_rows == {r["kernel"]: (r["products"], r["registers"], r["spill_stores"], r["shared"],
                                             r["num_warps"]) for r in rows}
    check_readme_spills(rows, 0)


HEAD_SIZES = [(128, 128), (256, 256), (128, 512)]
"""The (K, V) columns of the README's spill table."""


def readme_spills(column: int, any_triton: bool = False) -> dict[str, int] | None:
    """The README's spill stores per kernel at ``HEAD_SIZES[column]`` (a kernel it
    does not list spills nothing), or None when the installed triton is not the
    one it names (unless ``any_triton``)."""
    import re

    import triton
    from doc_tables import paragraph_before, table_rows

    version = re.search(r"ptxas of triton (\S+);", paragraph_before("head-size-spills"))
    assert version, "the README names the triton of its spill table"
    if version[1] != triton.__version__ and not any_triton:
        return None
    return {cells[0]: int(cells[1 + column].replace(",", "")) for cells in table_rows("head-size-spills")
            if cells[0] != "kernel"}


def check_readme_spills(rows: list[dict], column: int) -> None:
    """The README's spill stores at ``HEAD_SIZES[column]`` are ``rows``', when
    the installed triton is the one it names."""
    from doc_tables import README

    stated = readme_spills(column)
    if stated is None:
        return
    assert {r["kernel"]: r["spill_stores"] for r in rows} == {r["kernel"]: stated.get(r["kernel"], 0) for r in rows}
    assert set(stated) <= {r["kernel"] for r in rows}, README


@pytest.mark.skipif(os.environ.get("GDN_KCP_COMPILE_LARGE") != "1",
                    reason="set GDN_KCP_COMPILE_LARGE=1 (make compile-check): minutes per head size")
@pytest.mark.parametrize("column", [1, 2])
def test_every_kernel_compiles_at_fla_head_sizes(tmp_path, column):
    """(K, V) = (256, 256) and (128, 512): every kernel compiles for sm_90 on
    tensor cores (or exact FMA) as at 128, within shared memory, with the
    README's spills."""
    K, V = HEAD_SIZES[column]
    rows = compile_kernels(90, tmp_path, True, "--K", str(K), "--V", str(V))
    assert len(rows) == N_KERNELS and all(r["registers"] > 0 for r in rows)
    print("\n" + "\n".join(f"{r['kernel']}: {r['spill_stores']} B" for r in rows))
    assert not [r for r in rows if r["shared"] > SHARED_MEMORY_LIMIT]
    assert {r["kernel"] for r in rows if r["products"] != "-"} == WITH_PRODUCTS
    assert all(r["products"] == "fma" if r["kernel"] in EXACT_PRODUCTS else r["products"] in ("wgmma", "mma")
               for r in rows if r["products"] != "-"), rows
    check_readme_spills(rows, column)


@pytest.mark.skipif(os.environ.get("GDN_KCP_COMPILE_LARGE") != "1",
                    reason="set GDN_KCP_COMPILE_LARGE=1 (make compile-check): the larger head sizes")
@pytest.mark.parametrize("K, V", [(256, 256), (128, 512)])
def test_decode_kernels_compile_at_fla_head_sizes(tmp_path, K, V):
    """The decode step programs at the larger head sizes of the compile check:
    within shared memory; no spill but where the README lists one (within the
    spill limit on any triton, its figure on the README's; the K = V = 128
    case is in the table above)."""
    rows = compile_kernels(90, tmp_path, True, "--K", str(K), "--V", str(V), "--kernels", DECODE_KERNELS)
    assert [r["kernel"] for r in rows] == DECODE_KERNELS.split(",")
    listed = {name for name, spill in readme_spills(HEAD_SIZES.index((K, V)), any_triton=True).items() if spill}
    assert all(r["registers"] > 0 and r["shared"] <= SHARED_MEMORY_LIMIT for r in rows), rows
    assert all(r["spill_stores"] <= (SPILL_LIMIT if r["kernel"] in listed else 0) for r in rows), rows
    stated = readme_spills(HEAD_SIZES.index((K, V)))
    if stated is not None:
        assert {r["kernel"]: r["spill_stores"] for r in rows} == {r["kernel"]: stated.get(r["kernel"], 0) for r in rows}


def stated_kernel_table() -> dict | None:
    """The sm_90 kernel table of docs/cuda.md (the one after "ptxas of triton X, sm_90")
    by kernel name, or None when the installed triton is not X."""
    import re

    import triton
    from doc_tables import doc

    lines = doc("cuda.md").splitlines()
    marker = next((i for i, line in enumerate(lines) if re.search(r"ptxas of triton \S+, sm_90", line)), None)
    if marker is None or re.search(r"ptxas of triton (\S+), sm_90", lines[marker])[1] != triton.__version__:
        return None
    rows, started = {}, False
    for line in lines[marker + 1:]:
        if not line.strip().startswith("|"):
            if started:
                break
            continue
        started = True
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "kernel" or set(cells[0]) <= set("-:"):
            continue
        name, products, registers, spills, shared, warps = cells
        rows[name] = (products, int(registers), int(spills.replace(",", "")), int(shared.replace(",", "")),
                      int(warps))
    return rows


@pytest.mark.skipif(os.environ.get("GDN_KCP_COMPILE_SM100") != "1",
                    reason="set GDN_KCP_COMPILE_SM100=1 (make compile-check)")
def test_every_kernel_compiles_for_sm100(tmp_path):
    rows = compile_kernels(100, tmp_path)
    assert len(rows) == N_KERNELS
    assert all(r["shared"] <= SHARED_MEMORY_LIMIT for r in rows), rows


def test_specs_specialise_the_ints_a_launch_specialises():
    """Each spec compiles as a launch at its head dims specialises it: the ints
    K and V fix get ``tt.divisibility`` 16 exactly when 16 divides their value
    (triton's rule for an int argument); a stream's counts and the head counts
    get none. At (K, V) = (128, 512) an ``[M]`` block is K wide and starts at
    column V, an S block V wide at 0; at K = 72 neither K nor a row of the
    plane (V + K = 584 columns) is divisible, its 72 rows (42,048) are."""
    import triton

    from gdn_kcp.kernels.triton.compile_specs import kernels, shape_ints, source

    def jit(kernel):  # under TRITON_INTERPRET the kernels are interpreted functions; the spec reads a JITFunction's
        return kernel if hasattr(kernel, "params") else triton.runtime.jit.JITFunction(kernel.fn)

    specs = {name: (jit(kernel), constexprs) for name, kernel, constexprs in kernels(128, 512)}
    assert shape_ints("summary_walk_kernel[M]", 128, 512)["WIDTH"] == 128
    assert shape_ints("summary_walk_kernel", 128, 512)["WIDTH"] == 512
    assert (shape_ints("summary_walk_kernel[M]", 128, 512)["out_col"], shape_ints("l2_rstd_kernel", 128, 512)["D"]) \
        == (512, 128)
    for K, expected in ((128, {"K", "V", "WIDTH", "stride_h", "stride_k", "out_col"}), (72, {"V", "WIDTH", "out_col", "stride_h"})):
        kernel, constexprs = specs["summary_walk_kernel"]
        attrs = source("summary_walk_kernel", kernel, constexprs, K, 512).attrs
        divisible = {p.name for i, p in enumerate(kernel.params) if (i,) in attrs}
        assert divisible - {"k", "w", "u", "g", "gate_params", "k_rstd", "chunk_table", "frag_table",
                            "initial_state", "out", "k_decayed", "chunk_decay"} == expected, (K, divisible)


def test_kda_counts_are_the_compiled_code(tmp_path):
    """The model's counts of KDA's intra-chunk products and pulls
    (``kda_counts.SASS``, of triton 3.6, which the model prices, and of 3.9)
    are what ``tools/sass_counts.py`` reads off their sm_90 SASS now, for
    the triton installed (3.6's: the tool run with that triton first on the
    path, as ``make roofline-facts`` installs it): a change of the code that
    moves them fails here until the model says so."""
    import triton

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    try:
        import kda_counts
    finally:
        sys.path.pop(0)
    version = ".".join(triton.__version__.split(".")[:2])
    if version not in kda_counts.SASS:
        pytest.skip(f"kda_counts holds the SASS counts of triton {sorted(kda_counts.SASS)}, not {version}")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, os.path.join(root, "tools", "sass_counts.py"), "--json"], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = json.loads(result.stdout.splitlines()[-1])
    for name, facts in kda_counts.SASS[version].items():
        assert {key: compiled[name][key] for key in facts} == facts, name


@pytest.mark.skipif(not os.environ.get("GDN_KCP_FLA_SITE"), reason="GDN_KCP_FLA_SITE: a fla-core 0.5.1 site")
def test_fla_kda_counts_are_the_compiled_code(tmp_path):
    """``kda_counts.FLA_SASS`` is what ``tools/sass_counts.py --fla-site``
    reads off FLA 0.5.1's intra kernels now, under triton 3.6 (their block
    pointers are gone from 3.9): run with ``GDN_KCP_FLA_SITE`` a ``pip
    install --target`` of fla-core 0.5.1 and triton 3.6.0, first on the path."""
    import triton

    if not triton.__version__.startswith("3.6"):
        pytest.skip(f"FLA 0.5.1's intra kernels compile under triton 3.6, not {triton.__version__}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    try:
        import kda_counts
    finally:
        sys.path.pop(0)
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path))
    site = os.environ["GDN_KCP_FLA_SITE"]
    result = subprocess.run([sys.executable, os.path.join(root, "tools", "sass_counts.py"), "--json", "--fla-site",
                             site], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = json.loads(result.stdout.splitlines()[-1])
    for name, facts in kda_counts.FLA_SASS.items():
        assert {key: compiled[name][key] for key in facts} == facts, name
