"""The elementwise work of KDA's programs, ours and FLA 0.5.1's, in one unit:
what the roofline's KDA rows (``our_launches.our_kda_launches``,
``fla_launches.fla_kda_kernel_launches``) price, and what ``roofline.py
--kda-table`` prints, per chunk of C = 64 tokens and value head.

**The unit is the issue slot**: one warp-lane instruction of the FP32 and ALU
pipes (FADD, FMUL, FFMA, FSEL, FSETP: each 1), issued at 128 a clock per SM
on sm_90, the rate of the fp32 peak, which counts an FMA as 2 FLOPs: so a
slot costs 2 FLOPs of that peak (:data:`FLOP_PER_SLOT`), whatever the
instruction. An exponential is its instructions as triton compiles them
(:data:`EXP_SLOTS`, :data:`EXP2_SLOTS`); MUFU.EX2 issues 16 a clock per SM,
so it counts :data:`MUFU_SLOTS`, added to the rest (a pessimistic choice
for both sides alike: the MUFU pipe runs beside the FMA pipe). A scan
(``tl.cumsum``) costs what its lowering issues per element
(:data:`SCAN_SLOTS`). A sum over an axis
counts one add per element (its cross-lane shuffles are left out on both
sides), a product a reduction feeds one FMA. Index arithmetic, loads,
stores and casts count on neither side (bytes count them). A mask that
folds at compile time (FLA's ``o_k < K`` at K = BK) counts nothing.

The per-instruction figures are the SASS of small probe kernels compiled
for sm_90 by triton 3.9 (a [64, 32] fp32 tile at 4 warps, instructions per
element beyond a plain copy): ``tl.exp`` 3 FMUL, FSETP and MUFU.EX2;
``tl.math.exp2`` (FLA's ``exp2``) MUFU.EX2 alone; ``tl.cumsum`` over the 64
rows 14 forward and 16 reverse (FADD, FSEL, SHFL, shared-memory stores and
loads); our ``softplus`` 43.5 instructions, two of them MUFU. They are facts of the
compiler, not of a GPU: how fast an H200 issues them (the model's compute
efficiency, fitted on GDN's tensor-core work) no calibration row has
measured.

Every count is read off the code (the programs that call
``kernels/triton/channel.py``; FLA 0.5.1's ``fla/ops/kda``, ``fla/ops/gla``,
``fla/ops/common/chunk_delta_h.py``, ``fla/ops/utils/cumsum.py``), at the
headline's options: the gate arrives activated on both sides (no softplus
runs; ``gate_loads`` says how many gate elements a program reads, each a
softplus with the gate in the kernel), q/k norm in the kernels, K = V = 128.
But our intra-chunk products and their pulls, whose dyadic levels reshape
their tiles: those are read off their compiled code (``tools/sass_counts.py``,
checked in ``tests/test_roofline.py``), the same instruction classes in
the same slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from launch_model import SOLVE_OPS  # a substitution step's slots a tile element, both sides'

MUFU_SLOTS = 8
"""A MUFU instruction (EX2, LG2, RCP) in FMA issue slots: 16 a clock per SM
against 128 (CUDA C++ programming guide, arithmetic instruction throughput,
compute capability 9.0)."""
EXP_SLOTS = 4 + MUFU_SLOTS
"""``tl.exp`` on fp32 (ours): 3 FMUL, FSETP, MUFU.EX2 (SASS, triton 3.9, sm_90)."""
EXP2_SLOTS = MUFU_SLOTS
"""``tl.math.exp2`` on fp32 (FLA's ``exp2``; its gates are cumulated in log2
units): MUFU.EX2 alone."""
SCAN_SLOTS = 15
"""``tl.cumsum`` over the rows of a [64, BK] (or [4, 16, BK]) tile, per
element: 14 forward, 16 reverse (SASS of a [64, 32] probe at 4 warps)."""
SOFTPLUS_SLOTS = 41.5 - 2 + 2 * MUFU_SLOTS + 3
"""Our ``softplus`` (SASS: 43.5 instructions an element, two MUFU) and the
gate's rate, bias and mask around it: the price of one gate element a
program reads with the gate in the kernel (``GATE``)."""
FLOP_PER_SLOT = 2
"""What a slot costs at the model's fp32 peak (67 TFLOP/s counts an FMA, one
slot, as 2 FLOPs)."""


@dataclass(frozen=True)
class Count:
    """Elementwise work: exponentials (MUFU.EX2), issue slots (the
    exponentials' included) and gate elements read."""

    exps: float = 0.0
    slots: float = 0.0
    gate_loads: float = 0.0

    def __add__(self, other: Count) -> Count:
        return Count(self.exps + other.exps, self.slots + other.slots, self.gate_loads + other.gate_loads)

    def __mul__(self, n: float) -> Count:
        return Count(self.exps * n, self.slots * n, self.gate_loads * n)

    @property
    def flops(self) -> float:
        """The slots as FLOPs of the fp32 peak (:data:`FLOP_PER_SLOT`)."""
        return FLOP_PER_SLOT * self.slots


def ops(n: float, slots: float = 1.0) -> Count:
    """``n`` elements of ``slots`` each, no exponential."""
    return Count(slots=n * slots)


def exps(n: float, slots: float = 0.0, per_exp: float = EXP_SLOTS) -> Count:
    """``n`` elements each with one exponential (``per_exp`` slots) and
    ``slots`` more."""
    return Count(exps=n, slots=n * (per_exp + slots))


def gates(n: float) -> Count:
    return Count(gate_loads=n)


# ---------------------------------------------------------------- ours (kernels/triton)

SUB = 16
"""Our sub-chunks and FLA's (``BC``): 16 rows, 4 to a chunk."""


SASS_K = 128
"""The key width :data:`SASS` was compiled at."""
SASS = {
    "3.6": {"products": {"ex2": 34_816, "mufu": 35_072, "fp32": 639_232},
            "pulls": {"ex2": 45_056, "mufu": 45_056, "fp32": 1_360_128}},
    "3.9": {"products": {"ex2": 34_816, "mufu": 35_072, "fp32": 654_464},
            "pulls": {"ex2": 45_056, "mufu": 45_056, "fp32": 1_175_808}},
}
"""``channel.channel_products`` (``products``) and ``channel.pair_levels``
with ``channel.channel_pulls`` over every key slice (``pulls``: a probe
kernel at the backward programs' 16 key columns and 8 warps), a chunk of 64
tokens and one value head at K = 128, sm_90 SASS, by triton (``python
tools/sass_counts.py --json``; 3.6 with that triton first on the path):
MUFU.EX2, every MUFU, and the FP32-pipe instructions (FADD, FMUL, FFMA,
FSEL, FSETP), each thread's, times the key-slice loop's 8 trips and the
threads, compiled at the headline's options (the gate arrives activated:
``GATE`` off; with the gate in the kernel the products' two softplus an
element made 1,317k and 49.4k under 3.9). Two exponentials an element of the
slice (``exp(g)`` of each row and of its next row), each computed twice over
in the products: at 16 key columns and 4 warps the ``[64, 16]`` tile's
layout holds every element in two threads."""
MODEL_TRITON = "3.6"
"""The triton whose SASS the model prices: the GPU check's (as the compile
facts of ``h200_facts.json``). Its pulls take 16 % more FP32-pipe
instructions than 3.9's."""
PRODUCTS_SASS = SASS[MODEL_TRITON]["products"]
PULLS_SASS = SASS[MODEL_TRITON]["pulls"]


def sass_count(facts: dict[str, int], C: int, K: int) -> Count:
    """A compiled count (:data:`PRODUCTS_SASS`, :data:`PULLS_SASS`) at key
    width K: every instruction lies in the key-slice loop, so the work scales
    with K; the gates read, two a row and channel (each row's and its next
    row's)."""
    if C != 64:
        raise ValueError(f"the dyadic levels are written out for 64-row chunks, got C={C}")
    per_channel = K / SASS_K
    return Count(exps=facts["ex2"] * per_channel, slots=(facts["fp32"] + MUFU_SLOTS * facts["mufu"]) * per_channel,
                 gate_loads=2 * C * K)


def products(C: int, K: int) -> Count:
    """``channel.channel_products``, one chunk and value head over all K, as
    compiled (:data:`PRODUCTS_SASS`): the dyadic levels, each pair's decay
    a product of two running products of ``exp(g)``, the levels of half
    width 8 to 1 elementwise, one FMA a pair and channel; the shuffles and
    shared-memory round trips of its layout changes are not priced (nor
    FLA's)."""
    return sass_count(PRODUCTS_SASS, C, K)


def pulls(C: int, K: int) -> Count:
    """``channel.channel_pulls`` with ``pair_levels``, one chunk and value
    head over all K, as compiled (:data:`PULLS_SASS`)."""
    return sass_count(PULLS_SASS, C, K)


def key_decays(C: int, K: int) -> Count:
    """``channel.channel_key_half`` over all K (one walk program, one chunk):
    ``K exp(G_C - G)`` by a reverse scan of the next rows' gates, the norm,
    the exponential and the product; ``gamma_C`` from the first row (a
    masked load summed) and the tail's first row (select, sum), K
    exponentials."""
    E = C * K
    return exps(E, SCAN_SLOTS + 1 + 1) + ops(3 * E) + exps(K) + gates(2 * E)


def query_decays(C: int, K: int, norm: bool = True) -> Count:
    """``channel.channel_decayed_rows`` over all K: ``q exp(G)`` by a scan,
    an exponential, the norm (when the caller passes it) and the product."""
    E = C * K
    return exps(E, SCAN_SLOTS + 1 + (1 if norm else 0)) + gates(E)


def our_kda_counts(C: int, K: int, V: int, BW: int, output_bv: int, inverse_slots: float) -> dict[str, Count]:
    """Each of our KDA programs' elementwise work a chunk and value head (a
    walk's: over its ``V / BW`` value-tile programs, which read the decays
    ``channel_decays_kernel`` formed once, as the segments' and the KCP
    summaries do (the model runs no KCP exchange); the output's programs
    still form their own).
    ``output_bv``: the output's value tile, each of which decays q again;
    ``inverse_slots``: the WY inverse's substitution and 8-row merges
    (``our_launches.inverse_work``, in slots)."""
    E, NW = C * K, -(-V // BW)
    state = K * BW  # a walk program's state rows decay: one FMA an element
    return {
        "channel_wy_inverse_kernel": products(C, K) + ops(4 * C * C) + ops(inverse_slots),
        "prep_kernel[channel]": exps(E, SCAN_SLOTS + 3) + gates(E) + ops(C * V),
        "channel_scores_kernel": products(C, K),
        # K's and Q's decays once (q normalised in the forward, raw in the backward: one product less, not
        # told apart here)
        "channel_decays_kernel": key_decays(C, K) + query_decays(C, K),
        "walk_output_kernel[channel]": ops(state + 2 * C * BW) * NW,
        "tape_walk_kernel[channel]": ops(state + C * BW) * NW,
        "output_kernel[channel]": products(C, K) + query_decays(C, K) * -(-V // output_bv)
        + ops(C * V),
        "bwd_local_dv_kernel[channel]": products(C, K) + ops(C * V),
        "adjoint_walk_kernel[channel]": ops(state + 4 * C * BW) * NW,
        # the pulls; the gates, the tail's reverse scan, dq's state term (scan, exponential, two products),
        # dk's end term, the norms, dg's terms and the last row's; dP's mask, scale and diagonal blocks
        "bwd_dqkwg_kernel[channel]": pulls(C, K) + gates(2 * E) + ops(E, SCAN_SLOTS)
        + exps(E, SCAN_SLOTS + 2) + exps(E, 1) + ops(E, 2 + 1 + 4 + 2 + 2) + ops(4 * C * C),
        # the pulls; exp(G) twice (scan, exponential), the norms, dA's operand, dk, dbeta, dg; dL's mask,
        # diagonal blocks, beta
        "bwd_wy_kernel[channel]": pulls(C, K) + exps(2 * E, SCAN_SLOTS) + gates(2 * E)
        + ops(E, 2 + 2 + 2 + 4 + 4 + 6) + ops(7 * C * C) + ops(3 * C * V),
        "bwd_gate_cumsum_channel_kernel": ops(E, SCAN_SLOTS),
        # a program, a chunk: on channel_decays' decays; where none were formed (the phase-1 summaries of a
        # backward that recomputes nothing) each forms its own ([own decays])
        "segment_summary_kernel[channel]": ops(K * BW + C * BW),
        "adjoint_segment_summary_kernel[channel]": ops(K * BW + 4 * C * BW),
        "segment_summary_kernel[channel, own decays]": key_decays(C, K) + ops(K * BW + C * BW),
        "adjoint_segment_summary_kernel[channel, own decays]": key_decays(C, K) + query_decays(C, K, norm=False)
        + ops(K * BW + 4 * C * BW),
    }


# ---------------------------------------------------------------- FLA 0.5.1 (fla/ops/kda)

FLA_SASS = {
    "chunk_kda_fwd_kernel_intra_token_parallel": {"ex2": 69_632, "mufu": 69_632, "fp32": 382_464},
    "chunk_kda_fwd_kernel_inter_solve_fused": {"ex2": 18_432, "mufu": 18_432, "fp32": 179_712},
    "chunk_kda_fwd_kernel_intra_sub_chunk": {"ex2": 16_384, "mufu": 16_384, "fp32": 141_952},
    "chunk_kda_fwd_kernel_inter_solve_fused[safe_gate]": {"ex2": 18_432, "mufu": 18_432, "fp32": 58_112},
    "chunk_kda_bwd_kernel_intra": {"ex2": 303_104, "mufu": 303_104, "fp32": 2_099_200},
    "chunk_kda_bwd_kernel_intra[safe_gate]": {"ex2": 65_536, "mufu": 65_536, "fp32": 330_752},
}
"""FLA 0.5.1's intra-chunk kernels a chunk and value head at K = 128 (:data:`SASS_K`),
read off their sm_90 SASS by triton 3.6 as ours are (:data:`SASS`): ``python
tools/sass_counts.py --fla-site SITE --json`` with that triton first on the
path, at the configurations the model picks, each loop at its trips
(``sass_counts.FLA_LOOPS``). What the model prices for them at K = 128, in
place of the counts read off their source (:func:`fla_kda_source_counts`),
which these put within 15 %: the token-parallel kernel 939k slots against
844k, the fused inter + solve 327k against 285k, the sub-chunk kernel 273k
against 279k, its safe-gate inter kernel 205k against 197k, the intra
backward 4,524k against 4,962k and 855k against 932k (safe gate). The
exponentials agree but for the intra backward's (303k against 299k; 66k
against 70k under the safe gate)."""


def fla_kda_counts(C: int, K: int, V: int, gla_bv: int, walk_bv: int) -> dict[str, Count]:
    """:func:`fla_kda_source_counts`, but for the intra-chunk kernels at C = 64,
    K = 128: their compiled counts (:data:`FLA_SASS`), as ours are read."""
    counts = fla_kda_source_counts(C, K, V, gla_bv, walk_bv)
    if (C, K) == (64, SASS_K):
        counts.update({label: Count(exps=f["ex2"], slots=f["fp32"] + MUFU_SLOTS * f["mufu"])
                       for label, f in FLA_SASS.items()})
    return counts


def fla_kda_source_counts(C: int, K: int, V: int, gla_bv: int, walk_bv: int) -> dict[str, Count]:
    """Each of FLA 0.5.1's ``chunk_kda`` kernels' elementwise work a chunk and
    value head (the walks': over their ``V / walk_bv`` value-tile programs;
    the output's over ``V / gla_bv``), both intra paths (``safe_gate`` False:
    the token-parallel kernel and the intra backward's per-column loops;
    True: ``[safe_gate]`` and the sub-chunk kernel). Its gates are a chunk
    cumsum in log2 units, so every decay is ``exp2`` (MUFU.EX2 alone)."""
    E, NB, BC = C * K, C // SUB, SUB
    triples = NB * BC * BC * K  # whole 16 x 16 blocks (the intra backward's loops mask rows, not columns)
    lower = C * (BC + 1) / 2 * K  # the token-parallel pairs j <= i of a sub-chunk
    pairs = NB * (NB - 1) // 2  # pairs of sub-chunks
    solve = ops(NB * (BC - 2) * SOLVE_OPS * BC * BC)
    NV, NWK = -(-V // gla_bv), -(-V // walk_bv)

    def exp2(n: float, slots: float = 0.0) -> Count:
        return exps(n, slots, EXP2_SLOTS)

    # the off-diagonal blocks of Aqk and Akk: 3 sub-chunks' q and k decayed to their first row (a difference,
    # exp2, mask; two products), 6 pairs' k decayed from it (a difference, exp2, a product)
    inter = exp2(3 * BC * K, 2 + 2) + exp2(pairs * BC * K, 2)
    # the intra backward, both paths: the lower blocks (6 pairs of k decayed, 3 sub-chunks' exp2 and two
    # products), the upper (6 pairs of q and beta k decayed: difference, exp2, two selects, two products, beta;
    # 3 sub-chunks' closing exp2), db, dq2, dg2, dk2's adds
    bwd_blocks = exp2(pairs * BC * K, 2) + exp2(3 * BC * K, 1 + 2) + exp2(pairs * BC * K, 1 + 2 + 2 + 1) \
        + exp2(3 * BC * K, 2) + ops(E, 4 + 3 + 2)
    # the diagonal blocks, safe_gate False: for each column j, every row's difference, exp2 and two
    # (product, product, select, add); both sides
    bwd_diagonal = exp2(2 * triples, 1 + 8) + ops(NB * BC * K)
    # safe_gate True: each side two exp2 about the middle row (difference and select: 2; each masked), the
    # operand products (one; beta k two), each product's decay and add (4); dA's masks per key tile program
    NK = -(-K // 32)
    bwd_diagonal_safe = exp2(4 * E, 1) + ops(E, 2 + 1 + 4) + ops(E, 2 + 2 + 4) + ops(4 * NB * NK * BC * BC)
    return {
        "chunk_local_cumsum_vector_kernel": ops(E, SCAN_SLOTS + 1),
        "chunk_local_cumsum_vector_kernel[reverse]": ops(E, SCAN_SLOTS),
        # per (i, j <= i, d): the difference, exp2, k_j's product, two FMAs (Aqk, Akk); beta on k_i
        "chunk_kda_fwd_kernel_intra_token_parallel": exp2(lower, 1 + 1 + 2) + ops(E),
        "chunk_kda_fwd_kernel_inter_solve_fused": inter + solve + ops(2 * NB * BC * BC),
        "chunk_kda_fwd_kernel_inter_solve_fused[safe_gate]": inter,
        # per element of each sub-chunk: the difference from the middle row, exp2 of it and of its negation
        # (each masked), the three operand products; the blocks' scale, beta and masks; the substitution
        "chunk_kda_fwd_kernel_intra_sub_chunk": exp2(2 * E, 1) + ops(E, 1 + 1 + 3) + ops(4 * NB * BC * BC) + solve,
        # k beta exp2(g), kg = k exp2(g_C - g) (difference, exp2, select, product), beta v; [qg]: q exp2(g)
        "recompute_w_u_fwd_kda_kernel": exp2(E, 2) + exp2(E, 3) + ops(C * V),
        "recompute_w_u_fwd_kda_kernel[qg]": exp2(E, 2) + exp2(E, 3) + ops(E) + ops(C * V),
        # a step: the state's rows decay by exp2(g_C) (K exponentials, K x BV products), per value tile
        "chunk_gated_delta_rule_fwd_kernel_h_blockdim64[gk]": (exp2(K) + ops(K * walk_bv)) * NWK,
        "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64[gk]": (exp2(K) + ops(K * walk_bv + C * walk_bv)) * NWK,
        # q exp2(g) per value-tile program, the scale, Aqk's mask
        "chunk_gla_fwd_kernel_o": exp2(E, 1) * NV + ops(C * V + C * C * NV),
        "chunk_kda_bwd_kernel_dAv": ops(2 * C * C + C * V),
        # exp2(g) and its products (gb, dq's two, kg), dk's exp2(g_C - g) (difference, select, product),
        # db, kdk, dgk, dg's seven, dk's FMA; <h, dh> and the value side's beta and db; dA's masks
        "chunk_kda_bwd_kernel_wy_dqkg_fused": exp2(E, 1 + 2 + 1) + exp2(E, 3) + ops(E, 1 + 1 + 1 + 7 + 1)
        + exp2(K, 1) + ops(K * V + 2 * C * V + 4 * C * C),
        "chunk_kda_bwd_kernel_intra": bwd_blocks + bwd_diagonal,
        "chunk_kda_bwd_kernel_intra[safe_gate]": bwd_blocks + bwd_diagonal_safe,
    }
