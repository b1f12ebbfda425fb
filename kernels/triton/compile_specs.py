"""The shipped launch configurations of every Triton kernel, as
``triton.compile`` sources: compile them for a GPU target without a GPU.

    python -m gdn_kcp.kernels.triton.compile_specs [--arch 90] [--K 128] [--V 128]
    python -m gdn_kcp.kernels.triton.compile_specs --report     # make compile-report
    python -m gdn_kcp.kernels.triton.compile_specs --report --K 256 --V 512 --kernels recurrent_kernel

prints one JSON line per kernel with its shared memory and warps (run it
with ``TRITON_INTERPRET`` unset: the interpreter has nothing to compile).
``--report`` also reads ptxas's log (registers, spill stores and loads per
thread) and the PTX (``wgmma`` / ``mma`` tensor-core instructions against
scalar ``fma.rn.f32``) of every kernel and prints a Markdown table; it
compiles in a fresh ``TRITON_CACHE_DIR`` so ptxas runs for every kernel.

The register and spill figures quoted in the kernel modules' docstrings and
comments were measured before :func:`source` gave the head dims the
divisibility a launch gives them (2026-12-04), unless they say otherwise:
they record why each block size, warp count and cap was chosen, not what a
launch compiles now (``--report`` says that; under it no kernel with a
product spills more than 16 B per thread at K = V = 128).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import re

import triton
import triton.language as tl
from triton.backends.compiler import BaseBackend, GPUTarget

from ._common import BT, head_block, value_block, walk_block
from .adjoint_segment_summary import adjoint_segment_summary_kernel
from .adjoint_summary import adjoint_summary_kernel, adjoint_value_block
from .adjoint_walk import adjoint_walk_kernel
from .bwd_dqkwg import BKS_DQKWG, BV_DQKWG, bwd_dqkwg_kernel
from .bwd_gate_cumsum import BK_CHANNEL as BK_GATE_CHANNEL, bwd_gate_cumsum_channel_kernel, bwd_gate_cumsum_kernel
from .bwd_local_dv import BKS_LOCAL_DV, BV_LOCAL_DV, bwd_local_dv_kernel
from .bwd_qk_norm import BT_NORM, bwd_qk_norm_kernel
from .bwd_wy import BKS_WY, BV_WY, bwd_wy_kernel
from .channel_decays import BKD, channel_decays_kernel
from .compose_adjoints import compose_adjoints_kernel
from .compose_segments import BKB_COMPOSE, BV_COMPOSE, compose_segments_kernel
from .output import BKS_OUTPUT, BV_OUTPUT, output_kernel
from .prep import BK_WU, BV_WU, l2_rstd_kernel, prep_kernel
from .recurrent import BV_RECURRENT, recurrent_kernel
from .channel import BKS_CHANNEL
from .scores import BKS_SCORES, SUB_ROWS, channel_scores_kernel, scores_kernel
from .segment_summary import segment_summary_kernel
from .short_conv import (BD_CONV, BD_STEP, BT_CONV, DW_BLOCKS, conv_step_kernel, short_conv_bwd_dw_kernel,
                         short_conv_bwd_dx_kernel, short_conv_fwd_kernel)
from .summary_walk import summary_walk_kernel
from .tape_walk import tape_walk_kernel
from .walk_output import walk_output_kernel
from .wy_inverse import BKS_INVERSE, channel_wy_inverse_kernel, wy_inverse_kernel

SHARED_MEMORY_LIMIT = 232_448
"""Dynamic shared memory per block on the H100 / H200 (227 KiB)."""

FLOATS = {"scale"}
INDEX_TABLES = {"chunk_table", "frag_table", "frag_rows", "reach"}
# Pointers in the input dtype (bf16 here): inputs, outputs, and the buffers of
# gdn_kcp.dtypes.INPUT_DTYPE_BUFFERS (A, w, u / v_new, h, dh, dv_new, dq_heads,
# dk_heads, dw); every other pointer is fp32.
INPUT_POINTERS = {
    "l2_rstd_kernel": {"x"},
    "wy_inverse_kernel": {"k", "g", "beta", "A_out"},
    "channel_wy_inverse_kernel": {"k", "g", "beta", "A_out"},
    "prep_kernel": {"k", "v", "g", "beta", "A", "w", "u"},
    "tape_walk_kernel": {"k", "g", "w", "u", "h_out", "v_new", "k_decayed"},
    "channel_decays_kernel": {"q", "k", "g", "k_decayed", "q_decayed"},
    "summary_walk_kernel": {"k", "g", "w", "u", "k_decayed"},
    "scores_kernel": {"q", "k", "g", "scores"},
    "channel_scores_kernel": {"q", "k", "g", "scores"},
    "walk_output_kernel": {"q", "k", "g", "w", "u", "scores", "o", "k_decayed", "q_decayed"},
    "output_kernel": {"q", "g", "k", "o", "h", "v_new"},
    "bwd_local_dv_kernel": {"q", "g", "k", "do", "dv"},
    "adjoint_walk_kernel": {"q", "g", "k", "w", "do", "dv_local", "dh", "dv", "k_decayed", "q_decayed"},
    "adjoint_summary_kernel": {"q", "g", "k", "w", "do", "dv_local", "k_decayed", "q_decayed"},
    "segment_summary_kernel": {"k", "g", "w", "u", "k_decayed"},
    "adjoint_segment_summary_kernel": {"q", "g", "k", "w", "do", "dv_local", "k_decayed", "q_decayed"},
    "compose_segments_kernel": set(),  # summaries, states and carry planes: all fp32
    "compose_adjoints_kernel": set(),
    "bwd_dqkwg_kernel": {"q", "g", "k", "h", "v_new", "do", "dh", "dv_new", "dq", "dk", "dw"},
    "bwd_wy_kernel": {"k", "g", "v", "beta", "A", "dw", "du", "dk_acc", "dv", "dbeta"},
    "bwd_gate_cumsum_kernel": {"dg"},
    "bwd_gate_cumsum_channel_kernel": set(),  # KDA: dgcum and dg are fp32 [T, HV, K]
    "bwd_qk_norm_kernel": {"dy_heads", "x", "dx"},
    "short_conv_fwd_kernel": {"x", "w", "b", "halo", "y"},
    "short_conv_bwd_dx_kernel": {"x", "w", "b", "halo", "dy", "dx", "dhalo"},
    "short_conv_bwd_dw_kernel": {"x", "w", "b", "halo", "dy"},
    "recurrent_kernel": {"q", "k", "v", "g", "beta", "o", "conv_in", "conv_w", "conv_b", "conv_out"},
    "conv_step_kernel": {"x", "state", "w", "b", "y", "state_out"},
}
CHANNEL_COMPUTE_POINTERS = {
    "bwd_dqkwg_kernel": {"dq", "dk"},
    "bwd_wy_kernel": {"dk_acc"},
    "bwd_qk_norm_kernel": {"dy_heads"},
}
"""Of ``INPUT_POINTERS``, the pointers a ``[channel]`` configuration (KDA's)
takes in fp32: the per-value-head dq and dk
(``gdn_kcp.dtypes.CHANNEL_COMPUTE_BUFFERS``)."""
WRITES = {
    "l2_rstd_kernel": {"rstd"},
    "wy_inverse_kernel": {"A_out"},
    "channel_wy_inverse_kernel": {"A_out"},
    "prep_kernel": {"w", "u"},
    "tape_walk_kernel": {"h_out", "v_new", "final_state"},
    "channel_decays_kernel": {"k_decayed", "q_decayed", "chunk_decay"},
    "summary_walk_kernel": {"out"},
    "scores_kernel": {"scores"},
    "channel_scores_kernel": {"scores"},
    "walk_output_kernel": {"o", "final_state"},
    "output_kernel": {"o"},
    "bwd_local_dv_kernel": {"dv"},
    "adjoint_walk_kernel": {"dh", "dv", "d_initial"},
    "adjoint_summary_kernel": {"nu"},
    "segment_summary_kernel": {"summary"},
    "adjoint_segment_summary_kernel": {"nu"},
    "compose_segments_kernel": {"start", "final_state", "out"},
    "compose_adjoints_kernel": {"end", "out"},
    "bwd_dqkwg_kernel": {"dq", "dk", "dw", "dg"},
    "bwd_wy_kernel": {"dk_acc", "dv", "dbeta", "dg_acc"},
    "bwd_gate_cumsum_kernel": {"dg"},
    "bwd_gate_cumsum_channel_kernel": {"dg"},
    "bwd_qk_norm_kernel": {"dx"},
    "short_conv_fwd_kernel": {"y"},
    "short_conv_bwd_dx_kernel": {"dx", "dhalo"},
    "short_conv_bwd_dw_kernel": {"dw_part", "db_part"},
    "recurrent_kernel": {"state", "o", "conv_out"},
    "conv_step_kernel": {"y", "state_out"},
}
"""The pointers each kernel stores to (its outputs; the decode step updates
``state`` in place). Under torch.compile nothing else may count as written:
``traced_launches`` and ``tests/test_traced_triton.py`` check it."""
INTS = {"n_chunks", "n_frag", "max_rows", "H_qk", "HV", "K", "V", "T", "H", "D", "WIDTH", "stride_h", "stride_k", "out_col"}


def kernels(K: int, V: int) -> list[tuple[str, object, dict]]:
    """``(name, kernel, constexprs)`` of every kernel at its shipped configuration."""
    BK, BV = head_block(K), value_block(V)
    # bf16 inputs (products on bf16 operands), the layer's in-kernel gate
    walk = dict(BT=BT, BK=BK, BV=BV, HAS_NORM=True, GATE=True, ACC=tl.float32, MM="bf16")
    beta = dict(BETA_SIGMOID=True, BETA_SCALE=1.0)
    # segments, phase 2: fp32 summaries and states, exact products (no MM)
    compose = dict(BK=BK, BV=min(BV_COMPOSE, value_block(V)), BKB=min(BKB_COMPOSE, BK), ACC=tl.float32)
    local_dv = dict(BT=BT, BKS=min(BKS_LOCAL_DV, BK), BV=min(BV_LOCAL_DV, head_block(V)), HAS_NORM=True, GATE=True,
                    ACC=tl.float32, MM="bf16", CHANNEL=False, SUB=SUB_ROWS, CMM="tf32")
    adjoint = dict(walk, BV=walk_block(V), HAS_FINAL=True, HAS_LAM=True, HAS_INITIAL=True, HAS_CARRY=True)
    conv = dict(W=4, HAS_BIAS=True, HAS_HALO=True, BT=BT_CONV, BD=BD_CONV, ACC=tl.float32)
    recurrent = dict(BK=triton.next_power_of_2(K), BV=BV_RECURRENT, GATE=True, BETA_SIGMOID=True, BETA_SCALE=1.0,
                     QK_NORM=True, HAS_INITIAL=True, EPS=1e-6, ACC=tl.float32)
    return [
        ("l2_rstd_kernel", l2_rstd_kernel, dict(EPS=1e-6, BT=BT, BD=BK, ACC=tl.float32)),
        ("wy_inverse_kernel", wy_inverse_kernel,
         dict(BT=BT, BKS=min(BKS_INVERSE, BK), HAS_NORM=True, GATE=True, ACC=tl.float32, MM="bf16", **beta)),
        ("prep_kernel", prep_kernel,
         dict(walk, BK=min(BK_WU, BK), BV=min(BV_WU, head_block(V)), CHANNEL=False, **beta)),
        # KDA (a gate per key channel): L's products on fp32 operands as tf32 (kernels.precision.channel_mode),
        # the inverse's merges and W, U on bf16 ones
        ("channel_wy_inverse_kernel", channel_wy_inverse_kernel,
         dict(BT=BT, BKS=min(BKS_CHANNEL, BK), HAS_NORM=True, GATE=True, ACC=tl.float32, MM="bf16", CMM="tf32",
              **beta)),
        ("prep_kernel[channel]", prep_kernel,
         dict(walk, BK=min(BK_WU, BK), BV=min(BV_WU, head_block(V)), CHANNEL=True, **beta)),
        ("tape_walk_kernel", tape_walk_kernel,
         dict(walk, BV=walk_block(V), HAS_INITIAL=True, HAS_S_IN=True, HAS_FINAL=True, HAS_CARRY=True, CHANNEL=False,
              DECAYED=False)),
        # KDA's walks read the decays channel_decays_kernel formed once a chunk
        ("channel_decays_kernel", channel_decays_kernel,
         dict(BT=BT, BKD=min(BKD, BK), HAS_Q=True, HAS_Q_NORM=True, HAS_K_NORM=True, GATE=True, ACC=tl.float32,
              MM="bf16")),
        ("tape_walk_kernel[channel]", tape_walk_kernel,
         dict(walk, BV=walk_block(V), HAS_INITIAL=True, HAS_S_IN=True, HAS_FINAL=True, HAS_CARRY=True, CHANNEL=True,
              DECAYED=True)),
        ("scores_kernel", scores_kernel,
         dict(BT=BT, BKS=min(BKS_SCORES, BK), HAS_NORM=True, GATE=True, ACC=tl.float32, MM="bf16")),
        # KDA (a gate per key channel): products on fp32 operands as tf32 (kernels.precision.channel_mode)
        ("channel_scores_kernel", channel_scores_kernel,
         dict(BT=BT, SUB=SUB_ROWS, BKS=min(BKS_CHANNEL, BK), HAS_NORM=True, GATE=True, ACC=tl.float32, MM="tf32")),
        ("walk_output_kernel", walk_output_kernel,
         dict(walk, BV=walk_block(V), HAS_INITIAL=True, HAS_S_IN=True, HAS_FINAL=True, HAS_CARRY=True, CHANNEL=False,
              DECAYED=False)),
        ("walk_output_kernel[channel]", walk_output_kernel,
         dict(walk, BV=walk_block(V), HAS_INITIAL=True, HAS_S_IN=True, HAS_FINAL=True, HAS_CARRY=True, CHANNEL=True,
              DECAYED=True)),
        ("summary_walk_kernel", summary_walk_kernel,
         dict(walk, BV=walk_block(V), IS_M=False, CHANNEL=False, DECAYED=False)),
        ("summary_walk_kernel[M]", summary_walk_kernel,
         dict(walk, BV=walk_block(K), IS_M=True, CHANNEL=False, DECAYED=False)),
        ("summary_walk_kernel[channel]", summary_walk_kernel,
         dict(walk, BV=walk_block(V), IS_M=False, CHANNEL=True, DECAYED=True)),
        ("summary_walk_kernel[M channel]", summary_walk_kernel,
         dict(walk, BV=walk_block(K), IS_M=True, CHANNEL=True, DECAYED=True)),
        ("output_kernel", output_kernel,
         dict(BT=BT, BKS=min(BKS_OUTPUT, BK), BV=min(BV_OUTPUT, head_block(V)), HAS_NORM=True, GATE=True,
              ACC=tl.float32, MM="bf16", CHANNEL=False, SUB=SUB_ROWS, CMM="tf32")),
        ("output_kernel[channel]", output_kernel,
         dict(BT=BT, BKS=min(BKS_CHANNEL, BK), BV=min(BV_OUTPUT, head_block(V)), HAS_NORM=True, GATE=True,
              ACC=tl.float32, MM="bf16", CHANNEL=True, SUB=SUB_ROWS, CMM="tf32")),
        # a pair of value heads of one key head (the roofline's shape), and one head (HV = H_qk)
        ("bwd_local_dv_kernel", bwd_local_dv_kernel, dict(local_dv, SHARE=2)),
        ("bwd_local_dv_kernel[one head]", bwd_local_dv_kernel, dict(local_dv, SHARE=1)),
        # KDA: one value head a program (its own gates), the scores as output_kernel[channel] forms them
        ("bwd_local_dv_kernel[channel]", bwd_local_dv_kernel,
         dict(local_dv, SHARE=1, BKS=min(BKS_CHANNEL, BK), CHANNEL=True)),
        ("adjoint_walk_kernel", adjoint_walk_kernel, dict(adjoint, CHANNEL=False, DECAYED=False)),
        ("adjoint_walk_kernel[channel]", adjoint_walk_kernel, dict(adjoint, CHANNEL=True, DECAYED=True)),
        ("adjoint_summary_kernel", adjoint_summary_kernel, dict(walk, CHANNEL=False, DECAYED=False)),
        ("adjoint_summary_kernel[channel]", adjoint_summary_kernel,
         dict(walk, BV=adjoint_value_block(K, V, True), CHANNEL=True, DECAYED=True)),
        ("segment_summary_kernel", segment_summary_kernel,
         dict(walk, BV=walk_block(V + K), HAS_U=True, CHANNEL=False, DECAYED=False)),
        ("segment_summary_kernel[channel]", segment_summary_kernel,
         dict(walk, BV=walk_block(V + K), HAS_U=True, CHANNEL=True, DECAYED=True)),
        ("compose_segments_kernel", compose_segments_kernel, dict(compose, HAS_INITIAL=True, HAS_S_IN=True,
                                                                  HAS_START=True, HAS_FINAL=True, HAS_OUT=False,
                                                                  LAST_ONLY=False, IS_M=False)),
        ("compose_segments_kernel[M]", compose_segments_kernel,
         dict(compose, BV=min(BV_COMPOSE, value_block(K)), HAS_INITIAL=False, HAS_S_IN=False, HAS_START=False,
              HAS_FINAL=False, HAS_OUT=True, LAST_ONLY=True, IS_M=True)),
        ("adjoint_segment_summary_kernel", adjoint_segment_summary_kernel, dict(walk, CHANNEL=False, DECAYED=False)),
        ("adjoint_segment_summary_kernel[channel]", adjoint_segment_summary_kernel,
         dict(walk, BV=adjoint_value_block(K, V, True), CHANNEL=True, DECAYED=True)),
        ("compose_adjoints_kernel", compose_adjoints_kernel,
         dict(compose, HAS_FINAL=True, HAS_LAM=True, HAS_END=True, HAS_OUT=False, FIRST_ONLY=False)),
        ("bwd_dqkwg_kernel", bwd_dqkwg_kernel,
         dict(walk, BKS=BKS_DQKWG, BV=BV_DQKWG, CHANNEL=False, SUB=SUB_ROWS, CMM="tf32")),
        ("bwd_dqkwg_kernel[channel]", bwd_dqkwg_kernel,
         dict(walk, BKS=BKS_DQKWG, BV=BV_DQKWG, CHANNEL=True, SUB=SUB_ROWS, CMM="tf32")),
        ("bwd_wy_kernel", bwd_wy_kernel,
         dict(walk, BKS=min(BKS_WY, BK), BV=min(BV_WY, BV), CHANNEL=False, SUB=SUB_ROWS, CMM="tf32", **beta)),
        ("bwd_wy_kernel[channel]", bwd_wy_kernel,
         dict(walk, BKS=min(BKS_WY, BK), BV=min(BV_WY, BV), CHANNEL=True, SUB=SUB_ROWS, CMM="tf32", **beta)),
        ("bwd_gate_cumsum_kernel", bwd_gate_cumsum_kernel, dict(BT=BT, ACC=tl.float32)),
        ("bwd_gate_cumsum_channel_kernel", bwd_gate_cumsum_channel_kernel,
         dict(BT=BT, BK=min(BK_GATE_CHANNEL, BK), ACC=tl.float32)),
        ("bwd_qk_norm_kernel", bwd_qk_norm_kernel, dict(BT=BT_NORM, BK=BK, HAS_NORM=True, ACC=tl.float32)),
        # KDA's: the per-value-head dq and dk in fp32 (CHANNEL_COMPUTE_POINTERS)
        ("bwd_qk_norm_kernel[channel]", bwd_qk_norm_kernel, dict(BT=BT_NORM, BK=BK, HAS_NORM=True, ACC=tl.float32)),
        ("short_conv_fwd_kernel", short_conv_fwd_kernel, conv),
        ("short_conv_bwd_dx_kernel", short_conv_bwd_dx_kernel, conv),
        ("short_conv_bwd_dw_kernel", short_conv_bwd_dw_kernel, dict(conv, BLOCKS=DW_BLOCKS)),
        # decode: the recurrent step (state fp32), the same with the layer's convolution in it (a decode
        # step of the layer), and the convolution cache's step
        ("recurrent_kernel", recurrent_kernel, dict(recurrent, CONV=False, W=1, CONV_BIAS=False, CHANNEL=False,
                                                    BETA_V=False)),
        ("recurrent_kernel[conv]", recurrent_kernel,
         dict(recurrent, CONV=True, W=4, CONV_BIAS=True, CHANNEL=False, BETA_V=False)),
        # KDA's decode (fused_recurrent_kda): a decay per key channel, activated, and FLA's beta per value channel
        ("recurrent_kernel[channel]", recurrent_kernel,
         dict(recurrent, GATE=False, CONV=False, W=1, CONV_BIAS=False, CHANNEL=True, BETA_V=True)),
        ("conv_step_kernel", conv_step_kernel, dict(W=4, HAS_BIAS=True, BD=BD_STEP, ACC=tl.float32)),
    ]


def _launch_fact(kernel, name: str, default: object) -> object:
    """The module attribute ``name`` of module ``X`` for its kernel ``X_kernel``
    (what its launcher passes: a constant, or ``max_registers``, a function of
    the constexprs), ``default`` for any other kernel."""
    module = importlib.import_module(kernel.fn.__module__)
    main = kernel.fn.__name__ == module.__name__.rsplit(".", 1)[1] + "_kernel"
    return getattr(module, name, default) if main else default


def num_warps(kernel) -> int:
    """The warps its launcher gives ``kernel`` (``NUM_WARPS``; Triton's default 4)."""
    return _launch_fact(kernel, "NUM_WARPS", 4)


def num_stages(kernel) -> int:
    """The pipeline stages its launcher gives ``kernel`` (``NUM_STAGES``; Triton's default 3)."""
    return _launch_fact(kernel, "NUM_STAGES", 3)


def launch_options(kernel, constexprs: dict) -> dict:
    """The compile options its launcher gives ``kernel`` at ``constexprs``:
    warps and stages (``NUM_WARPS`` and ``NUM_STAGES``, or per configuration
    ``warps(constexprs)`` and ``stages(constexprs)``) and, where its module
    caps them (``MAX_REGISTERS``, or a cap per configuration,
    ``max_registers(constexprs)``), ptxas's registers per thread."""
    per_configuration_warps = _launch_fact(kernel, "warps", None)
    per_configuration_stages = _launch_fact(kernel, "stages", None)
    options = {"num_warps": (per_configuration_warps(constexprs) if per_configuration_warps is not None
                             else num_warps(kernel)),
               "num_stages": (per_configuration_stages(constexprs) if per_configuration_stages is not None
                              else num_stages(kernel))}
    per_configuration = _launch_fact(kernel, "max_registers", None)
    max_registers = (per_configuration(constexprs) if per_configuration is not None
                     else _launch_fact(kernel, "MAX_REGISTERS", None))
    if max_registers is not None:
        options["maxnreg"] = max_registers
    return options


def input_pointers(name: str) -> set[str]:
    """The pointers of configuration ``name`` in the input dtype (``INPUT_POINTERS``,
    less ``CHANNEL_COMPUTE_POINTERS`` in a ``[channel]`` one)."""
    kernel = kernel_of(name)
    inputs = INPUT_POINTERS[kernel]
    return inputs - CHANNEL_COMPUTE_POINTERS.get(kernel, set()) if name.endswith("[channel]") else inputs


def kernel_of(name: str) -> str:
    """The kernel a row of :func:`kernels` names: a configuration's
    ``kernel[variant]`` is ``kernel``, as the profiler names its launches."""
    return name.split("[")[0]


def shape_ints(name: str, K: int, V: int) -> dict[str, int]:
    """The int arguments whose values the head dims fix, whatever the stream:
    K, V; a ``[S | M]`` plane block's width (``WIDTH``: V, or K for the
    ``[M]`` variants), column offset (``out_col``) and strides (``stride_k``,
    ``stride_h``: rows of V + K columns); the channels ``D`` of the q / k norm
    (K) and of the convolutions (``2 H_qk K + HV V``, here at one key head and
    two value heads). Each is a multiple of 16 whenever K and V are, at any
    head count. The counts of a stream (chunks, fragments, rows, tokens) and
    the head counts vary per call and stay unspecialised."""
    M = name.endswith("[M]")
    return {"K": K, "V": V, "WIDTH": K if M else V, "out_col": V if M else 0, "stride_k": V + K,
            "stride_h": K * (V + K), "D": K if kernel_of(name) == "l2_rstd_kernel" else 2 * K + 2 * V}


def source(name: str, kernel, constexprs: dict, K: int, V: int) -> triton.compiler.ASTSource:
    """The kernel as a launch at head dims (K, V) specialises it: every pointer
    16-byte aligned (``tt.divisibility``; tensors and workspace pools start on
    256-byte boundaries), and each int the head dims fix (:func:`shape_ints`)
    as triton specialises its value at a launch: ``tt.divisibility`` 16 when 16 divides
    it (``BaseBackend.get_int_specialization``). That is what a launch at
    K = V = 128 compiles: without it, ptxas gave bwd_dqkwg 255 registers and
    256 B per thread of spills (triton 3.6), with it 178 and none, since the
    rows' addresses are then known to be 16-byte aligned. Other ints stay
    unspecialised (a stream's counts vary per call)."""
    inputs = input_pointers(name)
    ints = shape_ints(name, K, V)
    signature, attrs = {}, {}
    for i, param in enumerate(kernel.params):
        if not param.is_constexpr and param.name not in FLOATS | INTS:
            attrs[(i,)] = [["tt.divisibility", 16]]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
        elif param.name in FLOATS:
            signature[param.name] = "fp32"
        elif param.name in INTS:
            signature[param.name] = "i32"
            if param.name in ints and BaseBackend.get_int_specialization(ints[param.name], align=True) == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif param.name in INDEX_TABLES:
            signature[param.name] = "*i32"
        elif param.name == "doc_bounds":  # the decode programs' int64 document bounds
            signature[param.name] = "*i64"
        else:
            signature[param.name] = "*bf16" if param.name in inputs else "*fp32"
    return triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)


def selected(K: int, V: int, only: list[str] | None) -> list[tuple[str, object, dict]]:
    """:func:`kernels`, or those named in ``only``."""
    rows = kernels(K, V)
    if only:
        unknown = sorted(set(only) - {name for name, _, _ in rows})
        if unknown:
            raise ValueError(f"unknown kernels {unknown}")
        rows = [row for row in rows if row[0] in only]
    return rows


def compile_all(arch: int, K: int = 128, V: int = 128, only: list[str] | None = None) -> list[dict]:
    """Compile every kernel (or those in ``only``) for ``sm_<arch>``: shared memory (bytes) and warps."""
    target = GPUTarget("cuda", arch, 32)
    out = []
    for name, kernel, constexprs in selected(K, V, only):
        compiled = triton.compile(source(name, kernel, constexprs, K, V), target=target,
                                  options=launch_options(kernel, constexprs))
        out.append(dict(kernel=name, arch=arch, K=K, V=V, shared=compiled.metadata.shared,
                        num_warps=compiled.metadata.num_warps))
    return out


def ptxas_facts(log: str) -> dict:
    """Registers and spill bytes per thread from a ``ptxas -v`` log."""
    def number(pattern: str) -> int:
        match = re.search(pattern, log)
        return int(match.group(1)) if match else 0

    return dict(registers=number(r"Used (\d+) registers"), spill_stores=number(r"(\d+) bytes spill stores"),
                spill_loads=number(r"(\d+) bytes spill loads"), stack=number(r"(\d+) bytes stack frame"))


def instruction_class(ptx: str, has_dot: bool) -> str:
    """How the kernel's matrix products run: ``wgmma`` / ``mma`` (tensor cores),
    ``fma`` (scalar fp32 FMA), or ``-`` (no ``tl.dot``)."""
    if not has_dot:
        return "-"
    for name in ("wgmma", "mma"):
        if re.search(rf"\b{name}\.", ptx):
            return name
    return "fma"


def report(arch: int, K: int = 128, V: int = 128, only: list[str] | None = None) -> list[dict]:
    """:func:`compile_all` with ptxas's figures and the instruction class of every
    kernel. Call it in a process whose ``TRITON_CACHE_DIR`` is fresh (a cached
    kernel skips ptxas and logs nothing)."""
    triton.knobs.nvidia.dump_ptxas_log = True
    target = GPUTarget("cuda", arch, 32)
    rows = []
    for name, kernel, constexprs in selected(K, V, only):
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(source(name, kernel, constexprs, K, V), target=target,
                                      options=launch_options(kernel, constexprs))
        has_dot = "tt.dot" in compiled.asm["ttir"]
        rows.append(dict(kernel=name, arch=arch, K=K, V=V, shared=compiled.metadata.shared,
                         num_warps=compiled.metadata.num_warps, num_stages=compiled.metadata.num_stages,
                         products=instruction_class(compiled.asm["ptx"], has_dot),
                         fma=len(re.findall(r"\bfma\.rn\.f32\b", compiled.asm["ptx"])), **ptxas_facts(log.getvalue())))
    return rows


def markdown(rows: list[dict]) -> str:
    """The compile table of docs/cuda.md: products, registers, spill stores (B/thread), shared memory, warps."""
    lines = ["| kernel | products | registers | spill stores (B/thread) | shared (B) | warps |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['products']} | {r['registers']} | {r['spill_stores']:,} | "
                     f"{r['shared']:,} | {r['num_warps']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--K", type=int, default=128)
    parser.add_argument("--V", type=int, default=128)
    parser.add_argument("--report", action="store_true", help="registers, spills and instruction class (Markdown)")
    parser.add_argument("--kernels", help="comma-separated kernel names (default: every kernel)")
    args = parser.parse_args()
    only = args.kernels.split(",") if args.kernels else None
    if args.report:
        rows = report(args.arch, args.K, args.V, only)
        print("\n".join(json.dumps(row) for row in rows))
        print(markdown(rows))
        return
    for row in compile_all(args.arch, args.K, args.V, only):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
