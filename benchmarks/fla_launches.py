"""FLA's launches as the roofline (benchmarks/roofline.py) counts them: every
kernel launch and torch op of fla-core 0.5.1's ``chunk_gated_delta_rule``
and ``chunk_kda`` forward and backward (``fla_kernels.FLA_KERNELS``,
``FLA_KDA_KERNELS``) at a configuration of each kernel's autotune list, with
the FLOPs and bytes each moves at a shape (:class:`launch_model.Shape`), and
the estimate with each kernel at the configuration the model finds fastest."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gdn_kcp.cost_model import H200, Launch, Machine, Work, terms, walk
from gdn_kcp.kernels.triton.compile_specs import SHARED_MEMORY_LIMIT

import fla_kernels  # benchmarks/fla_kernels.py: FLA 0.5.1's kernel table
import kda_counts  # benchmarks/kda_counts.py: KDA's elementwise work, both sides
from launch_model import BF16, F32, SOLVE_OPS, Shape, estimate

# ---------------------------------------------------------------- FLA (fla-core 0.5.1)

FLA_DEFAULT_CONFIGS = {label: spec.configs[0] for label, spec in fla_kernels.FLA_KERNELS.items()}
"""A configuration of each FLA kernel where no facts pick one (FLOP counts:
only the output kernel's value tile changes them)."""


def fla_kernel_launches(s: Shape, label: str, config: Mapping) -> list[Launch]:
    """The launches of one FLA kernel in a forward+backward, at ``config`` (its
    block sizes change the programs and the bytes: the walks' and the output's
    value tile, the l2norm's rows per program)."""
    C, K, V, HV, H, NC, n = s.C, s.K, s.V, s.HV, s.H, s.NC, BF16
    docs, per_doc = s.fragments, s.chunks_per_fragment
    rows = s.T * H  # rows of q or k for the L2 norm
    if label in ("l2norm_fwd_kernel", "l2norm_bwd_kernel"):
        BT, tiles = config["BT"], (2 if label == "l2norm_fwd_kernel" else 3)  # x, y / y, dy, dx
        phase = "fwd" if label == "l2norm_fwd_kernel" else "bwd"
        return [Launch(phase, label, -(-rows // BT), Work(fp32=2 * BT * K, bytes=BT * (tiles * K * n + F32)))] * 2
    if label == "chunk_local_cumsum_scalar_kernel":
        return [Launch("fwd", label, NC * HV, Work(bytes=C * (n + F32)))]
    if label == "chunk_local_cumsum_scalar_kernel[reverse]":
        return [Launch("bwd", label, NC * HV, Work(bytes=2 * C * F32))]
    if label == "chunk_gated_delta_rule_fwd_kkt_solve_kernel":
        BC = 16
        solve_steps = 4 * (BC - 2)  # four diagonal blocks, rows 2 .. BC - 1 each
        return [Launch("fwd", label, NC * HV,
                       Work(bf16=10 * 2 * BC * BC * K, tf32=16 * 2 * BC**3, fp32=solve_steps * SOLVE_OPS * BC * BC,
                            bytes=C * K * n + C * (F32 + n) + 10 * BC * BC * n),
                       solve_steps, Work(fp32=SOLVE_OPS * BC * BC))]
    if label == "recompute_w_u_fwd_kernel":
        w_u = Work(bf16=2 * C * C * (K + V), bytes=C * C * n + C * (n + F32) + 2 * C * V * n + 2 * C * K * n)
        return [Launch(phase, label, NC * HV, w_u) for phase in ("fwd", "bwd")]
    if label == "chunk_gated_delta_rule_fwd_kernel_h_blockdim64":
        BV = config["BV"]
        step = Work(bf16=2 * (2 * C * K * BV), bytes=K * BV * n + 2 * C * K * n + 2 * C * BV * n + C * F32)
        return [walk(phase, label, docs * HV * -(-V // BV), per_doc, step) for phase in ("fwd", "bwd")]
    if label == "chunk_fwd_kernel_o":
        BV = config["BV"]
        return [Launch("fwd", label, NC * HV * -(-V // BV),
                       Work(bf16=2 * C * C * K + 2 * C * K * BV + 2 * C * C * BV,
                            bytes=2 * C * K * n + K * BV * n + C * F32 + 2 * C * BV * n))]
    if label == "chunk_bwd_kernel_dv_local":
        return [Launch("bwd", label, NC * HV,
                       Work(bf16=2 * C * C * K + 2 * C * C * V, bytes=2 * C * K * n + C * F32 + 2 * C * V * n))]
    if label == "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64":
        BV = config["BV"]
        step = Work(bf16=3 * (2 * C * K * BV), bytes=K * BV * n + C * F32 + 3 * C * BV * n + 3 * C * K * n)
        return [walk("bwd", label, docs * HV * -(-V // BV), per_doc, step)]
    if label == "chunk_bwd_kernel_dqkwg":
        return [Launch("bwd", label, NC * HV,
                       Work(bf16=2 * C * C * V + 3 * (2 * C * K * V) + 2 * (2 * C * C * K),
                            bytes=3 * C * V * n + 2 * K * V * n + 2 * C * K * n + 3 * C * K * n + 2 * C * F32))]
    if label == "prepare_wy_repr_bwd_kernel":
        return [Launch("bwd", label, NC * HV,
                       Work(bf16=2 * C * C * (5 * K + 2 * V + 2 * C),
                            bytes=2 * C * K * n + 3 * C * V * n + C * K * n + C * C * n + 2 * C * n + 2 * C * F32))]
    raise KeyError(label)


def fla_torch_ops(s: Shape) -> list[Launch]:
    """FLA 0.5.1's torch ops between its kernels (bytes read and written)."""
    K, HV, H, n = s.K, s.HV, s.H, BF16

    def op(phase: str, label: str, nbytes: int) -> Launch:
        return Launch(phase, None, 1, Work(bytes=nbytes), label=f"torch: {label}")

    gva = [op("bwd", f"{name} GVA sum", (HV * K + H * K) * s.T * n) for name in ("dq", "dk", "dk2")] if HV != H else []
    return [op("fwd", "A = zeros", s.T * HV * s.C * n), *gva,
            op("bwd", "dg sum over K blocks", 2 * s.T * HV * F32),
            op("bwd", "dk += dk2", 3 * s.T * H * K * n), op("bwd", "dg += dg2", 3 * s.T * HV * F32),
            op("bwd", "dg to bf16", s.T * HV * (F32 + n))]


def fla_launches(s: Shape, configs: Mapping[str, Mapping] | None = None) -> list[Launch]:
    """Every launch of FLA's forward+backward (fla-core 0.5.1), each kernel at
    ``configs[label]`` (default: the first of its list)."""
    configs = {**FLA_DEFAULT_CONFIGS, **(configs or {})}
    kernels = [launch for label in fla_kernels.FLA_KERNELS for launch in fla_kernel_launches(s, label, configs[label])]
    return kernels + fla_torch_ops(s)


def best_fla_facts(s: Shape, fla_facts: Mapping[str, Mapping[str, Mapping]], m: Machine = H200,
                   kernel_launches: Callable[[Shape, str, Mapping], list[Launch]] = fla_kernel_launches
                   ) -> dict[str, dict]:
    """Each FLA kernel's compile facts at the configuration of its list with
    the least modelled time at shape ``s`` (summed over its launches, which
    ``kernel_launches`` gives: GDN's by default, :func:`fla_kda_kernel_launches`
    for KDA's), among those that can launch (shared memory within a block's
    ``SHARED_MEMORY_LIMIT``: the autotuner prunes the others)."""
    best = {}
    for label, by_config in fla_facts.items():
        def cost(facts: Mapping) -> float:
            return sum(terms(launch, facts, m)["time"] for launch in kernel_launches(s, label, facts["config"]))
        best[label] = min((f for f in by_config.values() if f["shared"] <= SHARED_MEMORY_LIMIT), key=cost)
    return best


def fla_estimate(s: Shape, fla_facts: Mapping[str, Mapping[str, Mapping]], m: Machine = H200,
                 kernel_launches: Callable[[Shape, str, Mapping], list[Launch]] = fla_kernel_launches,
                 launches: Callable[[Shape, Mapping], list[Launch]] = fla_launches) -> dict:
    """FLA's estimate at shape ``s``, every kernel at its best configuration
    (GDN's launches by default; KDA's: :func:`fla_kda_estimate`)."""
    best = best_fla_facts(s, fla_facts, m, kernel_launches)
    return estimate(launches(s, {label: f["config"] for label, f in best.items()}), best, m)


# ---------------------------------------------------------------- FLA KDA (fla-core 0.5.1 chunk_kda)

KDA_SUB_CHUNK = 16
"""``BC``: the sub-chunk of KDA's intra-chunk kernels (16 rows; 4 to a chunk of 64)."""


WALK_LABELS = ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64[gk]",
               "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64[gk]")
"""FLA's KDA state walks (their value tile sets how often a step's decays are formed)."""


def fla_kda_count(s: Shape, label: str, config: Mapping) -> kda_counts.Count:
    """FLA's elementwise work of kernel ``label`` a chunk and value head at
    ``config`` (:func:`kda_counts.fla_kda_counts`; the walks' and the output's
    value tiles set how often a decay is formed)."""
    gla_bv = config["BV"] if label == "chunk_gla_fwd_kernel_o" else s.V
    walk_bv = config["BV"] if label in WALK_LABELS else s.V
    return kda_counts.fla_kda_counts(s.C, s.K, s.V, gla_bv, walk_bv)[label]


def fla_kda_kernel_launches(s: Shape, label: str, config: Mapping) -> list[Launch]:
    """The launches of one kernel of FLA 0.5.1's ``chunk_kda`` forward+backward
    (:data:`fla_kernels.FLA_KDA_KERNELS`, and under ``safe_gate``
    :data:`fla_kernels.FLA_KDA_SAFE_GATE_KERNELS`) at ``config`` (the walks',
    the output's and the cumsum's tiles, the token-parallel kernel's heads per
    program, the l2norm's rows change the programs and the bytes). FLOPs: 2 m
    n k per product each program computes; the elementwise work (the
    token-parallel and the intra backward's diagonal blocks, every decay, the
    scans) is :func:`fla_kda_count`'s, in issue slots priced at the fp32
    peak, as ours (``kda_counts``). Where a program's work depends on its
    place in the chunk (the token-parallel and the intra backward kernels),
    the work is the programs' mean."""
    C, K, V, HV, H, NC, n = s.C, s.K, s.V, s.HV, s.H, s.NC, BF16
    G, BC = HV // H, KDA_SUB_CHUNK
    NS = C // BC  # sub-chunks per chunk
    docs, per_doc = s.fragments, s.chunks_per_fragment
    rows = s.T * H  # rows of q or k for the L2 norm

    def elementwise(share: float = 1) -> Work:  # a program's share of the kernel's work a chunk and value head
        return Work(fp32=fla_kda_count(s, label, config).flops / share)

    if label == "l2norm_fwd_kernel":  # GDN's: q and k
        return fla_kernel_launches(s, label, config)
    if label == "l2norm_bwd_kernel[fp32 dy]":  # y, dx bf16; dy fp32 (dq / dk summed in fp32); rstd
        BT = config["BT"]
        return [Launch("bwd", label, -(-rows // BT), Work(fp32=2 * BT * K, bytes=BT * (2 * K * n + K * F32 + F32)))] * 2
    if label in ("chunk_local_cumsum_vector_kernel", "chunk_local_cumsum_vector_kernel[reverse]"):
        BS = config["BS"]  # a [C, BS] tile per program: bf16 g in, fp32 out / fp32 dg in and out
        reverse = label.endswith("[reverse]")
        return [Launch("bwd" if reverse else "fwd", label, -(-K // BS) * NC * HV,
                       Work(bytes=C * BS * ((F32 if reverse else n) + F32)) + elementwise(-(-K // BS)))]
    if label == "chunk_kda_fwd_kernel_intra_token_parallel":
        # A program per token and BH value heads: for each earlier token j of its sub-chunk and itself (J on
        # average), two K-long contractions per head (Aqk and Akk entries); it reads its own q, k, g rows and
        # beta, k and g rows of the J - 1 earlier tokens, and writes J entries of Aqk (bf16) and Akk (fp32).
        heads = min(config["BH"], HV)
        qk_heads = -(-heads // G)  # the key heads its value heads share
        J = (BC + 1) / 2
        return [Launch("fwd", label, s.T * -(-HV // heads),
                       Work(bytes=2 * qk_heads * K * n + heads * (K * F32 + n)
                            + (J - 1) * (qk_heads * K * n + heads * K * F32) + J * heads * (n + F32))
                       + elementwise(C / heads))]
    if label == "chunk_kda_fwd_kernel_intra_sub_chunk":
        # safe_gate: a program per sub-chunk: q, k (bf16), g (fp32) and beta in; two [BC, K] x [K, BC] products
        # (fp32 operands: tf32) about the middle row; Aqk's diagonal block (bf16) and Akk's inverted one (fp32) out
        return [Launch("fwd", label, NS * NC * HV,
                       Work(tf32=2 * 2 * BC * BC * K, bytes=BC * K * (2 * n + F32) + BC * n + BC * BC * (n + F32))
                       + elementwise(NS), BC - 2, Work(fp32=kda_counts.FLOP_PER_SLOT * SOLVE_OPS * BC * BC))]
    if label in ("chunk_kda_fwd_kernel_inter_solve_fused", "chunk_kda_fwd_kernel_inter_solve_fused[safe_gate]"):
        # Off-diagonal blocks: Aqk and Akk per pair of sub-chunks (fp32 operands: tf32 products); the
        # substitution on the NS diagonal blocks (rows 2 .. BC - 1; the sub-chunk kernel's under safe_gate); the
        # merge, d + 1 products of BC^3 for each block d below the diagonal (16 at NS = 4, tf32).
        pairs = NS * (NS - 1) // 2
        solve_steps = 0 if label.endswith("[safe_gate]") else NS * (BC - 2)
        merges = sum((NS - d) * (d + 1) for d in range(1, NS))
        return [Launch("fwd", label, NC * HV,
                       Work(tf32=2 * pairs * 2 * BC * BC * K + merges * 2 * BC**3,
                            bytes=C * K * n + (C - BC) * K * n + C * K * F32 + NS * BC * BC * F32 + (NS - 1) * BC * n
                            + pairs * BC * BC * n + NS * (NS + 1) // 2 * BC * BC * n) + elementwise(),
                       solve_steps, Work(fp32=kda_counts.FLOP_PER_SLOT * SOLVE_OPS * BC * BC))]
    if label in ("recompute_w_u_fwd_kda_kernel", "recompute_w_u_fwd_kda_kernel[qg]"):
        # A (bf16) times beta V and beta exp(g) K; reads beta, A, v, k, g; writes u, w, kg (and qg from q)
        qg = label.endswith("[qg]")
        w_u = Work(bf16=2 * C * C * (K + V),
                   bytes=C * n + C * C * n + 2 * C * V * n + C * K * (n + F32) + 2 * C * K * n
                   + (2 * C * K * n if qg else 0)) + elementwise()
        return [Launch("bwd" if qg else "fwd", label, NC * HV, w_u)]
    if label == "chunk_gated_delta_rule_fwd_kernel_h_blockdim64[gk]":
        # per step: h out, W S, K^T V; reads w, kg (K columns), u, the gate's last row (fp32); writes v_new
        BV = config["BV"]
        NV = -(-V // BV)
        step = Work(bf16=2 * (2 * C * K * BV), bytes=K * BV * n + 2 * C * K * n + 2 * C * BV * n + K * F32) \
            + elementwise(NV)
        return [walk(phase, label, docs * HV * NV, per_doc, step) for phase in ("fwd", "bwd")]
    if label == "chunk_gla_fwd_kernel_o":
        # (q exp(g)) S and Aqk V per value tile; reads q, g (fp32), h, Aqk, v_new; writes o
        BV = config["BV"]
        NV = -(-V // BV)
        return [Launch("fwd", label, NC * HV * NV,
                       Work(bf16=2 * C * K * BV + 2 * C * C * BV,
                            bytes=C * K * (n + F32) + K * BV * n + C * C * n + 2 * C * BV * n) + elementwise(NV))]
    if label == "chunk_kda_bwd_kernel_dAv":
        # dO Vn^T and Aqk^T dO; reads Aqk, v_new, do; writes dv (bf16) and dAqk (fp32)
        return [Launch("bwd", label, NC * HV,
                       Work(bf16=2 * (2 * C * C * V), bytes=C * C * n + 3 * C * V * n + C * C * F32) + elementwise())]
    if label == "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64[gk]":
        # per step: dh out; K dS, qg^T dO, W^T dV; reads do, dv, kg, qg, w, the gate's last row; writes dv2
        BV = config["BV"]
        NV = -(-V // BV)
        step = Work(bf16=3 * (2 * C * K * BV), bytes=K * BV * n + K * F32 + 3 * C * BV * n + 3 * C * K * n) \
            + elementwise(NV)
        return [walk("bwd", label, docs * HV * NV, per_doc, step)]
    if label == "chunk_kda_bwd_kernel_wy_dqkg_fused":
        # dO S^T, Vn dS, dV S^T (dq, dk, dw) over K x V; dV V^T and A dV (dA, du: its first key tile);
        # dW kg^T and A dW over K; dA's two products with A
        return [Launch("bwd", label, NC * HV,
                       Work(bf16=3 * (2 * C * K * V) + 2 * (2 * C * C * V) + 2 * (2 * C * C * K) + 2 * (2 * C**3),
                            bytes=C * n + C * C * n + C * K * (2 * n + F32) + 3 * C * K * F32 + 2 * K * V * n
                            + 5 * C * V * n + C * C * F32 + C * F32) + elementwise())]
    if label in ("chunk_kda_bwd_kernel_intra", "chunk_kda_bwd_kernel_intra[safe_gate]"):
        # A program per sub-chunk and key tile BK: dAqk, dAkk (fp32) times the gated k of each earlier sub-chunk
        # and, transposed, the gated q and beta k of each later one (NS - 1 in all: tf32 products); the two
        # diagonal blocks elementwise (fp32), or under safe_gate as four [BC, BC] x [BC, BK] products about the
        # middle row (tf32); reads its own g, q, k, beta, dq, dk, dg, writes dq2, dk2, dg2, db; the earlier
        # sub-chunks' k, g and the later ones' q, k, g, beta and their dA blocks (the mean: (NS - 1) / 2 of each)
        BK = min(32, 1 << (K - 1).bit_length())
        NK = -(-K // BK)
        block = 2 * BC * BC * BK
        diagonal = 4 * block if label.endswith("[safe_gate]") else 0
        others = (NS - 1) / 2 * (BC * BK * (n + F32) + BC * BK * (2 * n + F32) + BC * n + 2 * 2 * BC * BC * F32)
        return [Launch("bwd", label, NK * NS * NC * HV,
                       Work(tf32=(NS - 1) * 2 * block + diagonal,
                            bytes=BC * BK * (F32 + 2 * n) + BC * n + 6 * BC * BK * F32 + BC * F32 + 2 * BC * BC * F32
                            + others) + elementwise(NK * NS))]
    raise KeyError(label)


def fla_kda_torch_ops(s: Shape) -> list[Launch]:
    """FLA 0.5.1's torch ops between ``chunk_kda``'s kernels (bytes read and
    written): the zeroed Akk and o, the intra backward's db partials (one per
    key tile of 32) summed and added to the fused kernel's, the GVA sums of dq
    and dk (fp32), and the casts of dg and db to the bf16 inputs' dtype."""
    T, K, V, HV, H, n = s.T, s.K, s.V, s.HV, s.H, BF16
    NK = -(-K // min(32, 1 << (K - 1).bit_length()))

    def op(phase: str, label: str, nbytes: int) -> Launch:
        return Launch(phase, None, 1, Work(bytes=nbytes), label=f"torch: {label}")

    gva = [op("bwd", f"{name} GVA sum", (HV + H) * K * T * F32) for name in ("dq", "dk")] if HV != H else []
    return [op("fwd", "Akk = zeros", T * HV * s.C * n), op("fwd", "o = zeros", T * HV * V * n),
            op("bwd", "db sum over K blocks", (NK + 1) * T * HV * F32), op("bwd", "db += db2", 3 * T * HV * F32),
            *gva, op("bwd", "dg to bf16", T * HV * K * (F32 + n)), op("bwd", "db to bf16", T * HV * (F32 + n))]


SAFE_GATE_SWAPS = {"chunk_kda_fwd_kernel_intra_token_parallel": "chunk_kda_fwd_kernel_intra_sub_chunk",
                   "chunk_kda_fwd_kernel_inter_solve_fused": "chunk_kda_fwd_kernel_inter_solve_fused[safe_gate]",
                   "chunk_kda_bwd_kernel_intra": "chunk_kda_bwd_kernel_intra[safe_gate]"}
"""The kernels ``safe_gate=True`` runs in place of :data:`fla_kernels.FLA_KDA_KERNELS`' (its M = 16
tensor-core path: :data:`fla_kernels.FLA_KDA_SAFE_GATE_KERNELS`)."""


def fla_kda_labels(safe_gate: bool = False) -> list[str]:
    """FLA's ``chunk_kda`` kernels in launch order, on either intra path."""
    return [SAFE_GATE_SWAPS.get(label, label) if safe_gate else label for label in fla_kernels.FLA_KDA_KERNELS]


def fla_kda_launches(s: Shape, configs: Mapping[str, Mapping] | None = None, safe_gate: bool = False) -> list[Launch]:
    """Every launch of FLA's ``chunk_kda`` forward+backward (fla-core 0.5.1),
    each kernel at ``configs[label]`` (default: the first of its list), with
    ``safe_gate`` False (the token-parallel intra kernel) or True."""
    defaults = {label: spec.configs[0] for label, spec in
                {**fla_kernels.FLA_KDA_KERNELS, **fla_kernels.FLA_KDA_SAFE_GATE_KERNELS}.items()}
    configs = {**defaults, **(configs or {})}
    kernels = [launch for label in fla_kda_labels(safe_gate)
               for launch in fla_kda_kernel_launches(s, label, configs[label])]
    return kernels + fla_kda_torch_ops(s)


def kda_facts(facts: Mapping, safe_gate: bool = False) -> dict[str, Mapping]:
    """FLA's KDA compile facts (``facts["fla_kda"]``, and under ``safe_gate``
    the kernels of ``facts["fla_kda_safe_gate"]`` in place of those they
    replace), by label."""
    table = {**facts["fla_kda"], **(facts.get("fla_kda_safe_gate", {}) if safe_gate else {})}
    return {label: table[label] for label in fla_kda_labels(safe_gate)}


def best_fla_kda_facts(s: Shape, fla_kda_facts: Mapping[str, Mapping[str, Mapping]],
                       m: Machine = H200) -> dict[str, dict]:
    """:func:`best_fla_facts` for KDA's kernels (``kda_facts(facts, ...)``)."""
    return best_fla_facts(s, fla_kda_facts, m, fla_kda_kernel_launches)


def fla_kda_estimate(s: Shape, fla_kda_facts: Mapping[str, Mapping[str, Mapping]], m: Machine = H200,
                     safe_gate: bool = False) -> dict:
    """FLA ``chunk_kda``'s estimate at shape ``s``, every kernel at its best
    configuration (``fla_kda_facts``: :func:`kda_facts`' for the same
    ``safe_gate``)."""
    return fla_estimate(s, fla_kda_facts, m, fla_kda_kernel_launches,
                        lambda shape, configs: fla_kda_launches(shape, configs, safe_gate))
