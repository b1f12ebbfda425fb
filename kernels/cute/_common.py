"""CuTe DSL helpers shared by the programs: the target, the warpgroup MMA and
its shared-memory layouts, the chunk's gates and betas, and the compile cache.

Every program here is one warpgroup (128 threads) per chunk, the chunk's
``C = 64`` rows as the M of ``wgmma.m64nNk16`` (N = 64 or 128), operands
staged in shared memory through registers: the twins round an operand after
a per-row factor (the L2 norm, ``beta gamma``), so a tile goes global ->
registers (scaled, rounded to bf16 / fp16) -> 128-byte swizzled shared
memory, the layout wgmma reads without bank conflicts.
"""

from __future__ import annotations

import os

import torch

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..chunk_index import CHUNK_SIZE

C = CHUNK_SIZE
THREADS = 128
"""One warpgroup: the threads one ``wgmma`` spans."""
ARCH_ENV = "CUTE_DSL_ARCH"
DEFAULT_ARCH = "sm_90a"
"""The target without ``CUTE_DSL_ARCH``: the DSL itself would assume sm_100a
(nvidia-cutlass-dsl 4.8.1) and build tcgen05 code a Hopper cannot run."""
HEAD_DIMS = (64, 128)
"""K and V the programs are built and checked for; other sizes run the Triton twin."""
DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}
"""Input dtypes with a CuTe program (fp32 / fp64 run the Triton twin)."""
ELEMENT = {**DTYPES, torch.float32: cutlass.Float32, torch.int32: cutlass.Int32}


def target_arch() -> str:
    """``CUTE_DSL_ARCH`` or sm_90a."""
    return os.environ.get(ARCH_ENV, DEFAULT_ARCH)


def compile_options(arch: str | None = None) -> str:
    """``cute.compile``'s options string for ``arch`` (default :func:`target_arch`)."""
    return f"--gpu-arch {arch or target_arch()}"


def element(dtype: torch.dtype):
    """The DSL's element type of a torch dtype."""
    if dtype not in ELEMENT:
        raise ValueError(f"dtype must be one of {sorted(map(str, ELEMENT))}, got {dtype}")
    return ELEMENT[dtype]


def tiled_mma(dtype, n: int) -> cute.TiledMma:
    """``wgmma.m64n{n}k16``, both operands K-major in shared memory, fp32 accumulators."""
    return sm90_utils.make_trivial_tiled_mma(dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32,
                                             (1, 1, 1), (C, n))


def operand_layouts(dtype, n: int, depth: int):
    """Swizzled shared-memory layouts of the A ``[64, depth]`` and B ``[n, depth]``
    operands of ``[64, n] = A B^T`` (both K-major, one stage)."""
    tiler = (C, n, depth)
    return (sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tiler, dtype, 1),
            sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tiler, dtype, 1))


@cute.jit
def product(mma: cute.TiledMma, sA: cute.Tensor, sB: cute.Tensor, acc: cute.Tensor, tidx):
    """``acc = A B^T`` over the depth of the staged operands: one wgmma per 16 of it, then wait."""
    thr = mma.get_slice(tidx)
    rA = mma.make_fragment_A(thr.partition_A(sA))
    rB = mma.make_fragment_B(thr.partition_B(sB))
    mma.set(warpgroup.Field.ACCUMULATE, False)
    warpgroup.fence()
    for kb in cutlass.range_constexpr(cute.size(rA, mode=[2])):
        cute.gemm(mma, acc, rA[None, None, kb, 0], rB[None, None, kb, 0], acc)
        mma.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    warpgroup.wait_group(0)


@cute.jit
def staged(tidx):
    """Shared-memory writes of the generic proxy made visible to wgmma (the async proxy), then a barrier."""
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.sync_threads()


@cute.jit
def softplus(x):
    """``log(1 + exp(x))`` as torch computes it (x past 20 returned as is)."""
    out = x
    if x <= 20.0:
        out = cute.math.log1p(cute.math.exp(x))
    return out


@cute.jit
def gate_of(g: cute.Tensor, gate_params: cute.Tensor, tok, valid, h, GATE: cutlass.Constexpr):
    """Token ``tok``'s gate of value head ``h`` in fp32 (0 on a padded row); with
    ``GATE``, ``gate_params[0, h] * softplus(g + gate_params[1, h])``."""
    out = cutlass.Float32(0.0)
    if valid:
        out = g[tok, h].to(cutlass.Float32)
        if cutlass.const_expr(GATE):
            out = gate_params[0, h].to(cutlass.Float32) * softplus(out + gate_params[1, h].to(cutlass.Float32))
    return out


@cute.jit
def beta_of(beta: cute.Tensor, tok, valid, h, BETA_SIGMOID: cutlass.Constexpr, BETA_SCALE: cutlass.Constexpr):
    """Token ``tok``'s beta of head ``h`` in fp32: the input or its sigmoid, times the scale (0 on a padded row)."""
    out = cutlass.Float32(0.0)
    if valid:
        out = beta[tok, h].to(cutlass.Float32)
        if cutlass.const_expr(BETA_SIGMOID):
            out = 1.0 / (1.0 + cute.math.exp(-out))
        out = out * BETA_SCALE
    return out


_compiled: dict[tuple, object] = {}


def compiled(key: tuple, build):
    """The compiled program of ``key`` (``build()`` compiles it once per process)."""
    if key not in _compiled:
        _compiled[key] = build()
    return _compiled[key]
