"""Forward (CuTe DSL, sm_90a): the chunk's decayed causal scores, one
warpgroup per (chunk, key head), as the Triton program: ``Q K^T`` formed once
by wgmma (``m64n64k16``, K / 16 of them) and stored decayed by the gates of
each of the key head's value heads (GVA). Same signature as
``kernels.torch.scores``; compiled and checked on the CPU, not yet run on a GPU.

Shared memory: Q and K ``[64, K]`` in the input dtype (16 KB each at K = 128),
the value head's gates (256 B) and their segment sums
``sum_{j < l <= i} g_l`` ``[64, 64]`` fp32 (16 KB): each column summed down
its rows by one thread, so every sum adds exactly the gates it spans, as the
twins' (a -inf gate gives an exact zero decay, never ``-inf - -inf``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import cutlass
import cutlass.cute as cute

from .. import triton as triton_programs
from ..chunk_index import ChunkIndex
from ..tracing import traced
from ._common import C, DTYPES, HEAD_DIMS, THREADS, gate_of, operand_layouts, product, staged, tiled_mma
from .launch import CHUNKS, TOKENS, Launch, run


@dataclass(frozen=True)
class ScoresSpec:
    """What one scores program is specialised to, besides its tensors' dtypes and static shapes."""

    dtype: torch.dtype
    H_qk: int
    HV: int
    K: int
    has_norm: bool
    gate: bool


class ScoresProgram:
    """The kernel of one :class:`ScoresSpec` and its launch (grid ``(n_chunks, H_qk)``, 128 threads)."""

    def __init__(self, dtype, H_qk: int, HV: int, K: int, has_norm: bool, gate: bool):
        self.dtype, self.H_qk, self.HV, self.K = dtype, H_qk, HV, K
        self.has_norm, self.gate = has_norm, gate

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, g: cute.Tensor, gate_params: cute.Tensor,
                 q_rstd: cute.Tensor, k_rstd: cute.Tensor, scores: cute.Tensor, chunk_table: cute.Tensor,
                 stream):
        mma = tiled_mma(self.dtype, C)
        a_layout, b_layout = operand_layouts(self.dtype, C, self.K)
        self.kernel(q, k, g, gate_params, q_rstd, k_rstd, scores, chunk_table, mma, a_layout, b_layout).launch(
            grid=(chunk_table.shape[1], self.H_qk, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, q: cute.Tensor, k: cute.Tensor, g: cute.Tensor, gate_params: cute.Tensor,
               q_rstd: cute.Tensor, k_rstd: cute.Tensor, scores: cute.Tensor, chunk_table: cute.Tensor,
               mma: cute.TiledMma, a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        i_c, i_hk, _ = cute.arch.block_idx()
        start = chunk_table[0, i_c]
        length = chunk_table[1, i_c]
        smem = cutlass.utils.SmemAllocator()
        sQ = smem.allocate_tensor(self.dtype, a_layout.outer, 128, a_layout.inner)
        sK = smem.allocate_tensor(self.dtype, b_layout.outer, 128, b_layout.inner)
        sG = smem.allocate_tensor(cutlass.Float32, cute.make_layout(C), 16)
        sSeg = smem.allocate_tensor(cutlass.Float32, cute.make_layout((C, C), stride=(C, 1)), 16)
        self.stage_rows(q, q_rstd, sQ[None, None, 0], start, length, i_hk, tidx)
        self.stage_rows(k, k_rstd, sK[None, None, 0], start, length, i_hk, tidx)
        staged(tidx)
        acc = cute.make_rmem_tensor(mma.get_slice(tidx).partition_shape_C((C, C)), cutlass.Float32)
        product(mma, sQ, sK, acc, tidx)
        coords = mma.get_slice(tidx).partition_C(cute.make_identity_tensor((C, C)))
        group = self.HV // self.H_qk
        for i_g in cutlass.range(group):
            i_h = i_hk * group + i_g
            if tidx < C:
                sG[tidx] = gate_of(g, gate_params, start + tidx, tidx < length, i_h, self.gate)
            cute.arch.sync_threads()
            if tidx < C:  # column tidx: its segment sums down the rows below it
                running = cutlass.Float32(0.0)
                for i in cutlass.range_constexpr(C):
                    if i > tidx:
                        running = running + sG[i]
                    sSeg[i, tidx] = running
            cute.arch.sync_threads()
            for e in cutlass.range_constexpr(cute.size(acc)):
                row, col = coords[e]
                if row < length:
                    value = cutlass.Float32(0.0)
                    if col <= row:
                        value = acc[e] * cute.math.exp(sSeg[row, col])
                    scores[start + row, i_h, col] = value.to(scores.element_type)
            cute.arch.sync_threads()  # the next head rewrites sG and sSeg

    @cute.jit
    def stage_rows(self, x: cute.Tensor, rstd: cute.Tensor, sX: cute.Tensor, start, length, head, tidx):
        """Rows of ``x`` ``[T, H_qk, K]`` of this chunk into ``sX`` ``[64, K]``, L2-normalised in fp32
        when the program normalises, then rounded to the input dtype (padded rows 0)."""
        for it in cutlass.range_constexpr(C * self.K // THREADS):
            e = it * THREADS + tidx
            row = e // self.K
            col = e % self.K
            value = cutlass.Float32(0.0)
            if row < length:
                value = x[start + row, head, col].to(cutlass.Float32)
                if cutlass.const_expr(self.has_norm):
                    value = value * rstd[start + row, head].to(cutlass.Float32)
            sX[row, col] = value.to(self.dtype)


def covered(q: torch.Tensor, scores_out: torch.Tensor) -> bool:
    """Whether a CuTe program exists for this call (else the Triton twin runs)."""
    return (q.dtype in DTYPES and scores_out.dtype in DTYPES and q.shape[2] in HEAD_DIMS
            and scores_out.shape[1] % q.shape[1] == 0)


def plan(q, k, g, index: ChunkIndex, *, gate_params=None, q_rstd=None, k_rstd=None, scores_out) -> Launch:
    """The launch of a covered call: grid ``(n_chunks, H_qk)`` as the Triton program's."""
    H_qk, K, HV = q.shape[1], q.shape[2], scores_out.shape[1]
    spec = ScoresSpec(q.dtype, H_qk, HV, K, q_rstd is not None, gate_params is not None)
    spare = g  # read by no program whose flag is off
    names = ("q", "k", "g", "gate_params", "q_rstd", "k_rstd", "scores_out", "chunk_table")
    tensors = (q, k, g, spare if gate_params is None else gate_params, spare if q_rstd is None else q_rstd,
               spare if k_rstd is None else k_rstd, scores_out, index.chunk_table)
    symbolic = (TOKENS, TOKENS, TOKENS, TOKENS if gate_params is None else None, TOKENS, TOKENS, TOKENS, CHUNKS)
    program = ScoresProgram(DTYPES[q.dtype], H_qk, HV, K, spec.has_norm, spec.gate)
    return Launch(program, ("scores", spec), names, tensors, symbolic, (index.n_chunks, H_qk, 1))


def scores(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    scores_out: torch.Tensor,
) -> None:
    """See ``kernels.torch.scores``. bf16 / fp16 at K = 64 or 128; any other
    call (and a traced one: Inductor launches the Triton kernels) runs
    ``kernels.triton.scores``."""
    if traced() or not covered(q, scores_out):
        triton_programs.scores(q, k, g, index, gate_params=gate_params, q_rstd=q_rstd, k_rstd=k_rstd,
                               scores_out=scores_out)
        return
    if index.n_chunks == 0:
        return
    run(plan(q, k, g, index, gate_params=gate_params, q_rstd=q_rstd, k_rstd=k_rstd, scores_out=scores_out))
