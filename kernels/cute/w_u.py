"""Prep's second half (CuTe DSL, sm_90a): ``W = A diag(beta gamma) K`` and
``U = A diag(beta) V`` of one chunk and value head from a written A, the
launch the backward of ``save_mode="inverse"`` runs alone. One warpgroup per
(chunk, value head); each product is one wgmma chain (``m64nNk16``, N = K or
V, four of them over the chunk's 64 rows). Same signature as
``kernels.torch.prep.w_u``; compiled and checked on the CPU, not yet run on a GPU.

The right operand is staged transposed (``[N, 64]``, the chunk's rows
contiguous), so both operands are K-major and one swizzled layout serves
both products. As ``lower_matmul`` in the twins, a non-finite entry of
``diag(beta gamma) K`` (``diag(beta) V``) enters the product as 0 and its row
``t`` makes rows ``t..63`` of W (U) NaN: a NaN of token t stays at and after t.
Shared memory at K = V = 128: A 8 KB, both operands 32 KB, gates and flags 1 KB.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import cutlass
import cutlass.cute as cute

from .. import triton as triton_programs
from ..chunk_index import ChunkIndex
from ..tracing import traced
from ._common import C, DTYPES, HEAD_DIMS, THREADS, beta_of, gate_of, operand_layouts, product, staged, tiled_mma
from .launch import CHUNKS, TOKENS, Launch, run


@dataclass(frozen=True)
class WUSpec:
    """What one w_u program is specialised to, besides its tensors' dtypes and static shapes."""

    dtype: torch.dtype
    H_qk: int
    HV: int
    K: int
    V: int
    has_norm: bool
    gate: bool
    beta_sigmoid: bool
    beta_scale: float


class WUProgram:
    """The kernel of one :class:`WUSpec` and its launch (grid ``(n_chunks, HV)``, 128 threads)."""

    def __init__(self, dtype, spec: WUSpec):
        self.dtype, self.spec = dtype, spec

    @cute.jit
    def __call__(self, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, gate_params: cute.Tensor,
                 beta: cute.Tensor, A: cute.Tensor, k_rstd: cute.Tensor, w: cute.Tensor, u: cute.Tensor,
                 chunk_table: cute.Tensor, stream):
        s = self.spec
        mma_w, mma_u = tiled_mma(self.dtype, s.K), tiled_mma(self.dtype, s.V)
        a_layout, kt_layout = operand_layouts(self.dtype, s.K, C)
        _, vt_layout = operand_layouts(self.dtype, s.V, C)
        self.kernel(k, v, g, gate_params, beta, A, k_rstd, w, u, chunk_table, mma_w, mma_u, a_layout, kt_layout,
                    vt_layout).launch(grid=(chunk_table.shape[1], s.HV, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, k: cute.Tensor, v: cute.Tensor, g: cute.Tensor, gate_params: cute.Tensor,
               beta: cute.Tensor, A: cute.Tensor, k_rstd: cute.Tensor, w: cute.Tensor, u: cute.Tensor,
               chunk_table: cute.Tensor, mma_w: cute.TiledMma, mma_u: cute.TiledMma,
               a_layout: cute.ComposedLayout, kt_layout: cute.ComposedLayout, vt_layout: cute.ComposedLayout):
        s = self.spec
        tidx, _, _ = cute.arch.thread_idx()
        i_c, i_h, _ = cute.arch.block_idx()
        i_hk = i_h // (s.HV // s.H_qk)
        start = chunk_table[0, i_c]
        length = chunk_table[1, i_c]
        smem = cutlass.utils.SmemAllocator()
        sA = smem.allocate_tensor(self.dtype, a_layout.outer, 128, a_layout.inner)
        sKt = smem.allocate_tensor(self.dtype, kt_layout.outer, 128, kt_layout.inner)
        sVt = smem.allocate_tensor(self.dtype, vt_layout.outer, 128, vt_layout.inner)
        sGate = smem.allocate_tensor(cutlass.Float32, cute.make_layout(C), 16)
        sBetaGamma = smem.allocate_tensor(cutlass.Float32, cute.make_layout(C), 16)
        sBeta = smem.allocate_tensor(cutlass.Float32, cute.make_layout(C), 16)
        flags = cute.make_layout((2, C), stride=(C, 1))  # row 0: K's rows, row 1: V's
        sBad = smem.allocate_tensor(cutlass.Int32, flags, 16)
        sReached = smem.allocate_tensor(cutlass.Int32, flags, 16)
        if tidx < C:
            sGate[tidx] = gate_of(g, gate_params, start + tidx, tidx < length, i_h, s.gate)
            sBad[0, tidx] = 0
            sBad[1, tidx] = 0
        cute.arch.sync_threads()
        if tidx < C:  # G_t = sum_{l <= t} g_l, each row adding its own gates in order
            G = cutlass.Float32(0.0)
            for l in cutlass.range_constexpr(C):
                if l <= tidx:
                    G = G + sGate[l]
            b = beta_of(beta, start + tidx, tidx < length, i_h, s.beta_sigmoid, s.beta_scale)
            sBeta[tidx] = b
            sBetaGamma[tidx] = b * cute.math.exp(G)
        cute.arch.sync_threads()
        self.stage_a(A, sA[None, None, 0], start, length, i_h, tidx)
        self.stage_scaled_rows(k, k_rstd, sBetaGamma, sKt[None, None, 0], sBad, 0, start, length, i_hk, s.K,
                               True, tidx)
        self.stage_scaled_rows(v, k_rstd, sBeta, sVt[None, None, 0], sBad, 1, start, length, i_h, s.V, False,
                               tidx)
        staged(tidx)
        if tidx < C:  # row t reached by a non-finite row at or before it
            for which in cutlass.range_constexpr(2):
                reached = cutlass.Int32(0)
                for l in cutlass.range_constexpr(C):
                    if l <= tidx:
                        reached = reached | sBad[which, l]
                sReached[which, tidx] = reached
        cute.arch.sync_threads()
        acc_w = cute.make_rmem_tensor(mma_w.get_slice(tidx).partition_shape_C((C, s.K)), cutlass.Float32)
        product(mma_w, sA, sKt, acc_w, tidx)
        self.store(acc_w, mma_w, w, sReached, 0, start, length, i_h, s.K, tidx)
        acc_u = cute.make_rmem_tensor(mma_u.get_slice(tidx).partition_shape_C((C, s.V)), cutlass.Float32)
        product(mma_u, sA, sVt, acc_u, tidx)
        self.store(acc_u, mma_u, u, sReached, 1, start, length, i_h, s.V, tidx)

    @cute.jit
    def stage_a(self, A: cute.Tensor, sA: cute.Tensor, start, length, head, tidx):
        """The chunk's rows of A ``[T, HV, 64]`` into ``sA`` (padded rows 0), in A's dtype (the operand's)."""
        for it in cutlass.range_constexpr(C * C // THREADS):
            e = it * THREADS + tidx
            row = e // C
            col = e % C
            value = A.element_type(0.0)
            if row < length:
                value = A[start + row, head, col]
            sA[row, col] = value.to(self.dtype)

    @cute.jit
    def stage_scaled_rows(self, x: cute.Tensor, rstd: cute.Tensor, factor: cute.Tensor, sXt: cute.Tensor,
                          sBad: cute.Tensor, which: cutlass.Constexpr, start, length, head, D: cutlass.Constexpr,
                          NORM_ROWS: cutlass.Constexpr, tidx):
        """``diag(factor) X`` of the chunk's rows of ``x`` ``[T, H, D]`` into ``sXt`` ``[D, 64]`` (transposed),
        rounded to the input dtype; k is L2-normalised first when the program normalises. A non-finite
        entry is staged as 0 and flags its row in ``sBad[which]``."""
        for it in cutlass.range_constexpr(C * D // THREADS):
            e = it * THREADS + tidx
            row = e // D
            col = e % D
            value = cutlass.Float32(0.0)
            if row < length:
                value = x[start + row, head, col].to(cutlass.Float32)
                if cutlass.const_expr(NORM_ROWS and self.spec.has_norm):
                    value = value * rstd[start + row, head].to(cutlass.Float32)
                value = factor[row] * value
                if not cute.math.isfinite(value):
                    sBad[which, row] = 1
                    value = cutlass.Float32(0.0)
            sXt[col, row] = value.to(self.dtype)

    @cute.jit
    def store(self, acc: cute.Tensor, mma: cute.TiledMma, out: cute.Tensor, sReached: cute.Tensor,
              which: cutlass.Constexpr, start, length, head, D: cutlass.Constexpr, tidx):
        """The chunk's valid rows of ``acc`` ``[64, D]`` into ``out`` ``[T, H, D]``, NaN from a non-finite row on."""
        coords = mma.get_slice(tidx).partition_C(cute.make_identity_tensor((C, D)))
        for e in cutlass.range_constexpr(cute.size(acc)):
            row, col = coords[e]
            if row < length:
                value = acc[e]
                if sReached[which, row] != 0:
                    value = cutlass.Float32(float("nan"))
                out[start + row, head, col] = value.to(out.element_type)


def covered(k: torch.Tensor, v: torch.Tensor, A: torch.Tensor) -> bool:
    """Whether a CuTe program exists for this call (else the Triton twin runs)."""
    return (A.dtype in DTYPES and k.dtype in DTYPES and k.shape[2] in HEAD_DIMS and v.shape[2] in HEAD_DIMS
            and v.shape[1] % k.shape[1] == 0)


def plan(k, v, g, beta, A, index: ChunkIndex, *, gate_params=None, beta_sigmoid=False, beta_scale=1.0,
         k_rstd=None, w_out, u_out) -> Launch:
    """The launch of a covered call: grid ``(n_chunks, HV)`` as the Triton program's. A's dtype is the
    products' operand dtype, as in the twins."""
    spec = WUSpec(A.dtype, k.shape[1], v.shape[1], k.shape[2], v.shape[2], k_rstd is not None,
                  gate_params is not None, bool(beta_sigmoid), float(beta_scale))
    spare = g  # read by no program whose flag is off
    names = ("k", "v", "g", "gate_params", "beta", "A", "k_rstd", "w_out", "u_out", "chunk_table")
    tensors = (k, v, g, spare if gate_params is None else gate_params, beta, A, spare if k_rstd is None else k_rstd,
               w_out, u_out, index.chunk_table)
    symbolic = (TOKENS, TOKENS, TOKENS, TOKENS if gate_params is None else None, TOKENS, TOKENS, TOKENS, TOKENS,
                TOKENS, CHUNKS)
    return Launch(WUProgram(DTYPES[A.dtype], spec), ("w_u", spec), names, tensors, symbolic,
                  (index.n_chunks, spec.HV, 1))


def w_u(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    beta_sigmoid: bool = False,
    beta_scale: float = 1.0,
    k_rstd: torch.Tensor | None = None,
    w_out: torch.Tensor,
    u_out: torch.Tensor,
) -> None:
    """See ``kernels.torch.prep.w_u``. bf16 / fp16 at K, V in (64, 128); any
    other call (and a traced one) runs ``kernels.triton.w_u``."""
    kwargs = dict(gate_params=gate_params, beta_sigmoid=beta_sigmoid, beta_scale=beta_scale, k_rstd=k_rstd,
                  w_out=w_out, u_out=u_out)
    if traced() or not covered(k, v, A):
        triton_programs.w_u(k, v, g, beta, A, index, **kwargs)
        return
    if index.n_chunks == 0:
        return
    run(plan(k, v, g, beta, A, index, **kwargs))
