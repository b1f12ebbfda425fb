"""The elementwise work of KDA's intra-chunk products and pulls as sm_90
compiles them: instructions a chunk of 64 tokens and one value head, by
class, from the SASS of the installed triton (no GPU needed).

    python tools/sass_counts.py            # both, K = 128
    python tools/sass_counts.py --K 64 --json

``products``: ``channel_scores_kernel`` at its shipped configuration (the
products and a store: ``kernels.triton.channel.channel_products``) but for
the gate, which arrives activated (``GATE`` off), as the model's headline
and the pulls' probe have it.
``pulls``: a probe kernel that runs ``channel.pair_levels`` once and
``channel.channel_pulls`` over every key slice, at the backward programs'
slice (``BKS_WY``) and warps (8). Each instruction counts once per thread,
times the key-slice loop's trips (``K / BKS``) inside a runtime loop (a
backward branch; both kernels have that loop alone), times the threads.
``fp32`` sums the FP32-pipe classes (FADD, FMUL, FFMA, FSEL, FSETP, FMNMX),
``mufu`` the MUFU ones (``EX2``, the exponentials, and the others, ``MUFU``): what ``benchmarks/kda_counts.py``
prices, read here off the compiled code rather than the source.
Shuffles, shared-memory traffic and barriers (the layout changes of the
dyadic levels) are printed beside them; neither side's model prices them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

FP32_PIPE = ("FADD", "FMUL", "FFMA", "FSEL", "FSETP", "FMNMX")
SHOWN = FP32_PIPE + ("EX2", "MUFU", "SHFL", "LDS", "STS", "BAR", "HMMA", "HGMMA")


def class_counts(sass: str, trips) -> collections.Counter:
    """Instruction classes (the opcode before its first dot) of one kernel's
    SASS, each weighted by ``trips`` per runtime loop around it (a number
    for every loop, or a list of each loop's, the loops in address order)."""
    ins, loops = [], []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)([^;]*);", line)
        if not m:
            continue
        addr, op = int(m.group(1), 16), m.group(2)
        ins.append((addr, "EX2" if op.startswith("MUFU.EX2") else op.split(".")[0]))
        target = re.match(r"\s*0x([0-9a-f]+)", m.group(3))
        if op == "BRA" and target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    per_loop = list(trips) if isinstance(trips, (list, tuple)) else [trips] * len(loops)
    if len(per_loop) != len(loops):
        raise ValueError(f"trips names {len(per_loop)} loops, the SASS has {len(loops)}")
    counts = collections.Counter()
    for addr, op in ins:
        weight = 1
        for (first, last), n in zip(loops, per_loop):
            if first <= addr <= last:
                weight *= n
        counts[op] += weight
    return counts


def sass_of(compiled) -> str:
    cuobjdump = Path(sys.modules["triton"].__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True, check=True).stdout


def per_chunk(compiled, trips, programs: float = 1) -> dict:
    """Instructions a chunk and value head by class: ``programs`` of them
    (each the kernel's threads) at ``trips`` (:func:`class_counts`)."""
    counts = class_counts(sass_of(compiled), trips)
    threads = 32 * compiled.metadata.num_warps * programs
    row = {k: counts[k] * threads for k in SHOWN}
    row["fp32"] = sum(counts[k] for k in FP32_PIPE) * threads
    row["mufu"] = (counts["MUFU"] + counts["EX2"]) * threads
    row["ex2"] = counts["EX2"] * threads
    return row


def products(K: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    from gdn_kcp.kernels.triton import compile_specs
    from gdn_kcp.kernels.triton.channel import BKS_CHANNEL

    (name, kernel, constexprs), = compile_specs.selected(K, K, ["channel_scores_kernel"])
    constexprs = dict(constexprs, GATE=False)  # the headline's gate: activated, no softplus in the kernel
    compiled = triton.compile(compile_specs.source(name, kernel, constexprs, K, K), target=GPUTarget("cuda", 90, 32),
                              options=compile_specs.launch_options(kernel, constexprs))
    return per_chunk(compiled, -(-K // min(BKS_CHANNEL, K)))


def pulls(K: int) -> dict:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    from gdn_kcp.kernels.triton._common import BT, chunk_tokens, store_rows_cols
    from gdn_kcp.kernels.triton.bwd_wy import BKS_WY
    from gdn_kcp.kernels.triton.channel import channel_pulls, pair_levels

    @triton.jit
    def pulls_probe(dS, a, b, g, a_rstd, b_rstd, d_a, d_b, chunk_table, n_chunks, H_qk, HV, K,
                    BT: tl.constexpr, BKS: tl.constexpr, CMM: tl.constexpr):
        i_c, i_h = tl.program_id(0), tl.program_id(1)
        start, length = tl.load(chunk_table + i_c), tl.load(chunk_table + n_chunks + i_c)
        tok, o_t, m_t = chunk_tokens(start, length, BT)
        x = tl.load(dS + (tok[:, None] * HV + i_h) * BT + o_t[None, :], mask=m_t[:, None], other=0.0)
        l32, l16, l8, l4, l2, l1, l0 = pair_levels(tl.where(o_t[:, None] >= o_t[None, :], x, 0.0), BT)
        ones = tl.full([BT], 1.0, tl.float32)
        for c0 in range(0, K, BKS):
            x_a, x_b = channel_pulls(l32, l16, l8, l4, l2, l1, l0, a, b, a_rstd, b_rstd, g, g, ones, start, length,
                                     H_qk, i_h, HV, i_h, K, c0, BT, BKS, True, False, tl.float32, CMM)
            store_rows_cols(d_a, x_a, tok, m_t, HV, i_h, K, c0, BKS)
            store_rows_cols(d_b, x_b, tok, m_t, HV, i_h, K, c0, BKS)

    signature = {"dS": "*fp32", "a": "*bf16", "b": "*bf16", "g": "*fp32", "a_rstd": "*fp32", "b_rstd": "*fp32",
                 "d_a": "*fp32", "d_b": "*fp32", "chunk_table": "*i32", "n_chunks": "i32", "H_qk": "i32",
                 "HV": "i32", "K": "i32", "BT": "constexpr", "BKS": "constexpr", "CMM": "constexpr"}
    bks = min(BKS_WY, K)
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(9)}
    attrs[(12,)] = [["tt.divisibility", 16]]
    source = triton.compiler.ASTSource(fn=pulls_probe, signature=signature,
                                       constexprs={"BT": BT, "BKS": bks, "CMM": "tf32"}, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
    return per_chunk(compiled, -(-K // bks))


FLA_LOOPS = {
    "chunk_kda_fwd_kernel_intra_token_parallel": lambda K, c: (64 / c["BH"], [8.5]),
    "chunk_kda_fwd_kernel_inter_solve_fused": lambda K, c: (1, [K / c["BK"], 14, 14, 14, 14]),
    "chunk_kda_fwd_kernel_intra_sub_chunk": lambda K, c: (4, [14]),
    "chunk_kda_fwd_kernel_inter_solve_fused[safe_gate]": lambda K, c: (1, [K / c["BK"]]),
    "chunk_kda_bwd_kernel_intra": lambda K, c: (4 * K / 32, [1.5, 16, 1.5, 16]),
    "chunk_kda_bwd_kernel_intra[safe_gate]": lambda K, c: (4 * K / 32, [1.5, 1.5]),
}
"""FLA 0.5.1's intra-chunk KDA kernels (``fla/ops/kda/chunk_intra*.py``, 64-row
chunks of four 16-row sub-chunks), at key width K and configuration c: a
chunk and value head's programs and each SASS loop's trips a program (in
address order, as the source orders them), averaged over those programs. The token-parallel kernel: a program a
token and ``BH`` value heads, its loop over the token's sub-chunk up to it
(1 to 16 trips, 8.5 on average). The fused inter + solve kernel: one
program, the key blocks' loop, then a substitution loop of 14 steps per
sub-chunk (none under ``safe_gate``, whose sub-chunk kernel, four programs,
runs one). The intra backward: a program a sub-chunk and 32 key columns; the
earlier sub-chunks' loop (0 to 3 trips, 1.5 on average), the diagonal
block's column loop (16; none under ``safe_gate``), the later sub-chunks'
loop (3 to 0). Code outside the loops counts in every program, though some
of it runs under ``i_i > 0`` or ``i_i < NC - 1`` only (three programs in
four): FLA's counts here lean high, not low."""


def fla(K: int, site: str) -> dict:
    """:data:`FLA_LOOPS`' kernels at the configurations the model picks
    (``fla_launches.best_fla_kda_facts`` at the headline shape), compiled by
    the triton on the path, counted as :func:`per_chunk` counts ours."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import fla_kernels
    import fla_launches
    from launch_model import Shape
    from roofline import load_facts

    facts = load_facts()
    shape = Shape(K=K, V=K)
    best = {**fla_launches.best_fla_kda_facts(shape, fla_launches.kda_facts(facts, False)),
            **fla_launches.best_fla_kda_facts(shape, fla_launches.kda_facts(facts, True))}
    table = {**fla_kernels.FLA_KDA_KERNELS, **fla_kernels.FLA_KDA_SAFE_GATE_KERNELS}
    fla_kernels.import_fla(site)
    rows = {}
    for label, loops in FLA_LOOPS.items():
        config = best[label]["config"]
        programs, trips = loops(K, config)
        rows[label] = per_chunk(fla_kernels.compile_config(table[label], config), trips, programs)
        rows[label]["config"] = config
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--K", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--fla-site", help="FLA 0.5.1's intra kernels instead, from this fla-core site (with "
                        "triton 3.6: its block pointers are gone from 3.9)")
    args = parser.parse_args()
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # what a launch compiles (FMAs fused)
    if args.fla_site:
        rows = fla(args.K, args.fla_site)
    else:
        rows = {"products": products(args.K), "pulls": pulls(args.K)}
    if args.json:
        print(json.dumps(rows, default=str))
    else:
        print(f"a chunk of 64 tokens and one value head, K = {args.K}, sm_90 SASS (thousands)")
        print("| work | fp32 pipe | MUFU in all | " + " | ".join(SHOWN) + " |")
        print("|---|" + "---:|" * (2 + len(SHOWN)))
        for name, row in rows.items():
            print(f"| {name} | {row['fp32'] / 1e3:,.1f} | {row['mufu'] / 1e3:,.1f} | "
                  + " | ".join(f"{row[k] / 1e3:,.1f}" for k in SHOWN) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
