"""flash-linear-attention's own Triton ``chunk_kda`` (fla-core 0.5.1) on the KDA precision
cases of tests/precision_grid.py: the error ratio ``rms(fla - ref) / rms(ref)`` of o, ht and the
gradients dq, dk, dv, db, dg, dh0 (and dA, dbias under the gate in kernel) against the same
fp64 reference the table uses (``precision_grid.reference``), x 1e-3.

FLA's ``chunk_kda`` is called as ``precision_grid.ours`` calls ours: the same leaves, q and k
normalised by ``F.normalize`` outside unless the case normalises in the kernel
(``use_qk_l2norm_in_kernel``), the case's scale, h0 fp32, ``output_final_state=True``,
``chunk_size=64``, gate cases with ``use_gate_in_kernel=True, A_log, dt_bias``; the loss is
``(o * do).sum() + (ht * dht).sum()`` in fp64. In parentheses, as in the table: a tensor whose
largest absolute error is at most ``ABS_PASS`` (1e-6).

FLA's kernels run under triton 3.6's interpreter (``TRITON_INTERPRET=1``) on the CPU, with
``tools/fla_layer_check.py``'s three patches (autotuning takes the first configuration; FLA's
token-parallel intra kernel its widest head block, :func:`widest_token_parallel`) and a bf16
emulation (:func:`patch_bf16`): out of the box the interpreter keeps bf16 tiles as their raw uint16
bits and hands them to numpy, so a ``tl.dot``, a product or a sum of bf16 tiles works on integers
(garbage), and an fp32 -> bf16 cast truncates. Patched, bf16 tiles stay bf16 values, a ``tl.dot``
multiplies them exactly and accumulates in fp32 (as tensor cores do), arithmetic on bf16 tiles
runs in fp32 and rounds back to bf16 after each operation, a ``tl.sum`` of a bf16 tile adds in
bf16 (a pairwise tree rounded at each level; a GPU's order differs), and casts to bf16 round to
nearest even. fp16 needs no patch (numpy has fp16). A ``tl.dot`` of fp32 tiles is numpy's fp32
matmul: exact fp32 whatever its ``input_precision`` (a GPU reads those operands as tf32).
``--sites`` lists every ``tl.dot`` and bf16 operation run, with its operand dtypes and FLA's line.

The FLA site (fla-core 0.5.1, einops, triton 3.6.0 in a folder of their own, beside the venv's
torch)::

    D=$(mktemp -d) && .venv/bin/pip install -q --no-deps --target $D fla-core==0.5.1 einops==0.8.2 triton==3.6.0
    OMP_NUM_THREADS=1 .venv/bin/python tools/fla_kda_errors.py --site $D                 # the 4 gate cases, bf16
    OMP_NUM_THREADS=1 .venv/bin/python tools/fla_kda_errors.py --site $D --dtype fp16 --case 9 10
    .venv/bin/python tools/fla_kda_errors.py --list                                      # KDA_GRID's indices
    OMP_NUM_THREADS=1 .venv/bin/python tools/fla_kda_errors.py --site $D --case 6 --seed 1 2 3 --ours

``--seed`` draws the case's inputs from other seeds than the table's 42 (``precision_grid.make_inputs``),
one row per draw; ``--ours`` adds a row of our torch programs on each draw, so the spread of a figure
over draws, FLA's and ours, is read in one run (a reduction such as ``dA`` moves by 7x between draws).

(``--site`` defaults to ``$GDN_KCP_FLA_SITE``.) Slow: the last column is each case's seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = ("o", "ht", "dq", "dk", "dv", "db", "dg", "dh0", "dA", "dbias")
GATE_CASES = (9, 10, 6, 7)
"""KDA_GRID's gate cases, smallest first (the default)."""
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


MET: dict[tuple[str, str, str], int] = {}
"""``(operation, operand dtypes, FLA's file:line or ''): count`` of every ``tl.dot`` and every operation
on bf16 tiles the interpreter ran (:func:`patch_bf16`; the line with ``--sites``)."""
SITES = False
TF32_DOTS = True
"""A ``tl.dot`` of fp32 tiles at input precision ``tf32`` (the default, which FLA's KDA kernels take,
and on a GPU with tf32 its inverse's ``SOLVE_TRIL_DOT_PRECISION`` too) reads its operands as tf32, as
sm_90's tensor cores do; ``--exact-fp32-dots`` keeps the interpreter's exact fp32 products and FLA's
ieee inverse (the figures before this flag)."""


def _met(kind: str, operands: str) -> None:
    site = ""
    if SITES:  # the innermost frame of FLA's source
        frame = sys._getframe(2)
        while frame and "/fla/ops/" not in frame.f_code.co_filename:
            frame = frame.f_back
        site = f"{frame.f_code.co_filename.split('/fla/ops/')[-1]}:{frame.f_lineno}" if frame else "?"
    MET[kind, operands, site] = MET.get((kind, operands, site), 0) + 1


def patch_bf16() -> None:
    """bf16 in triton 3.6's interpreter as a GPU computes it (see the module's docstring)."""
    import numpy as np
    import triton.language as tl
    from interpreter_tf32 import reads_as_tf32, tf32_handle
    from triton.runtime.interpreter import InterpreterBuilder, ReduceOps, ScanOps, TensorHandle

    bf16 = tl.bfloat16

    def widen(h):  # a bf16 handle's values as fp32 (exact)
        if h.dtype.scalar != bf16:
            return h
        return TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def narrow(data):  # values rounded to the nearest bf16 (ties to even), as uint16 bits
        bits = np.asarray(data, dtype=np.float32).view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)

    def rounded(data):  # fp32 values rounded to bf16, kept fp32
        return (narrow(data).astype(np.uint32) << 16).view(np.float32)

    B = InterpreterBuilder
    dot, cast, binary, unary, fma = B.create_dot, B.cast_impl, B.binary_op, B.unary_op, B.create_fma

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        as_tf32 = TF32_DOTS and reads_as_tf32(a, b, input_precision)
        _met("tl.dot", f"{a.dtype.scalar} x {b.dtype.scalar}" + (" as tf32" if as_tf32 else ""))
        if as_tf32:
            a, b = tf32_handle(a), tf32_handle(b)
        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if dst_type.scalar == bf16 and src.dtype.scalar != bf16:
            _met("cast", f"{src.dtype.scalar} -> bf16")
            return TensorHandle(narrow(src.data.astype(np.float32)), bf16)
        return cast(self, widen(src), dst_type)

    def binary_op(self, lhs, rhs, op):
        if bf16 not in (lhs.dtype.scalar, rhs.dtype.scalar):
            return binary(self, lhs, rhs, op)
        _met(op.__name__, f"{lhs.dtype.scalar}, {rhs.dtype.scalar}")
        out = binary(self, widen(lhs), widen(rhs), op)
        return TensorHandle(narrow(out.data), bf16) if out.data.dtype == np.float32 else out

    def unary_op(self, arg, op):
        if arg.dtype.scalar != bf16:
            return unary(self, arg, op)
        _met(op.__name__, "bf16")
        return TensorHandle(narrow(unary(self, widen(arg), op).data), bf16)

    def create_fma(self, x, y, z):
        if z.dtype.scalar != bf16:
            return fma(self, x, y, z)
        _met("fma", "bf16")
        return TensorHandle(narrow(fma(self, widen(x), widen(y), widen(z)).data), bf16)

    # the class's create_fadd, create_exp, create_fp_trunc, ... call these by name
    B.create_dot, B.cast_impl, B.binary_op, B.unary_op, B.create_fma = (create_dot, cast_impl, binary_op,
                                                                         unary_op, create_fma)
    reduce_sum = ReduceOps.sum

    def bf16_sum(self, input):  # a GPU adds bf16 in bf16: a pairwise tree, rounded at each level
        if input.dtype != bf16:
            return reduce_sum(self, input)
        _met("tl.sum", "bf16")
        x = widen(input.handle).data
        x = np.moveaxis(x, self.axis, 0) if self.axis is not None else x.reshape(-1)
        while x.shape[0] > 1:
            if x.shape[0] % 2:
                x = np.concatenate([x, np.zeros_like(x[:1])])
            half = x.shape[0] // 2
            x = rounded(x[:half] + x[half:])
        x = x[0]
        if self.keep_dims:
            x = np.expand_dims(x, self.axis) if self.axis is not None else x.reshape((1,) * input.handle.data.ndim)
        return self.to_tensor(narrow(x), bf16)

    def refuse(method, name):
        def run(self, input, *args):
            if input.dtype == bf16:
                raise NotImplementedError(f"{name} of a bf16 tile is not emulated")
            return method(self, input, *args)
        return run

    ReduceOps.sum = bf16_sum
    ReduceOps.min_max = refuse(ReduceOps.min_max, "tl.min / tl.max")
    ScanOps.cumsum = refuse(ScanOps.cumsum, "tl.cumsum")


def widest_token_parallel() -> None:
    """FLA's token-parallel intra kernel with its widest head block (``BH`` 8) instead of the first
    configuration (``BH`` 1) that fla_layer_check's patch takes: each head's arithmetic is the same,
    the interpreter runs 8x fewer programs (it was three quarters of the time)."""
    from triton.runtime import autotuner

    init = autotuner.Autotuner.__init__

    def widest(self, fn, arg_names, configs, *args, **kwargs):
        kernel = fn
        while hasattr(kernel, "fn"):
            kernel = kernel.fn
        if kernel.__name__ == "chunk_kda_fwd_kernel_intra_token_parallel":
            configs = sorted(configs, key=lambda config: -config.kwargs["BH"])
        init(self, fn, arg_names, configs, *args, **kwargs)

    autotuner.Autotuner.__init__ = widest


def fla_results(chunk_kda, case, x):
    """FLA's chunk_kda on the case, called as precision_grid.ours calls ours."""
    import torch.nn.functional as F
    from precision_grid import _cu, _kda_keywords, _leaves, _results

    p = _leaves(x)
    q, k = (p["q"], p["k"]) if case.norm else (F.normalize(p["q"], p=2, dim=-1), F.normalize(p["k"], p=2, dim=-1))
    o, ht = chunk_kda(q, k, p["v"], p["g"], p["beta"], scale=case.scale, initial_state=p["h0"],
                      output_final_state=True, use_qk_l2norm_in_kernel=case.norm, cu_seqlens=_cu(case),
                      chunk_size=64, **_kda_keywords(case, p))
    return _results(o, ht, p, x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", default=os.environ.get("GDN_KCP_FLA_SITE"),
                        help="folder with fla-core 0.5.1, einops and triton 3.6.0 (default: $GDN_KCP_FLA_SITE)")
    parser.add_argument("--case", type=int, nargs="+", default=list(GATE_CASES),
                        help=f"indices into precision_grid.KDA_GRID, in this order (default: {GATE_CASES})")
    parser.add_argument("--dtype", nargs="+", choices=DTYPES, default=["bf16"], help="run each case in each")
    parser.add_argument("--list", action="store_true", help="print KDA_GRID's indices and cases, then stop")
    parser.add_argument("--sites", action="store_true",
                        help="also list every tl.dot and bf16 operation run, by FLA's file:line (slower)")
    parser.add_argument("--seed", type=int, nargs="+", default=[42], metavar="S",
                        help="draw each case's inputs from each seed S (default: the table's 42)")
    parser.add_argument("--ours", action="store_true",
                        help="also our torch programs on each draw, a row beside FLA's")
    parser.add_argument("--exact-fp32-dots", action="store_true",
                        help="fp32 tl.dot operands exact, not read as tf32 (a GPU reads them as tf32)")
    args = parser.parse_args()
    global SITES, TF32_DOTS
    SITES = args.sites
    TF32_DOTS = not args.exact_fp32_dots
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    if args.site:
        sys.path.insert(0, args.site)
    sys.path[1:1] = [str(ROOT / "tests"), str(ROOT / "tools")]
    import torch
    import triton
    from precision_grid import ABS_PASS, KDA_GRID, error_ratio, make_inputs, ours, reference

    if args.list:
        for i, case in enumerate(KDA_GRID):
            print(i, case.name)
        return 0
    if triton.__version__ != "3.6.0":
        raise SystemExit(f"--site must hold triton 3.6.0 (fla-core 0.5.1's), found {triton.__version__}")
    from fla_layer_check import patch_interpreter

    patch_interpreter()
    widest_token_parallel()
    patch_bf16()
    import fla
    import fla.utils

    # on sm_90 FLA's WY inverse takes tf32 products (SOLVE_TRIL_DOT_PRECISION, read at import); without a GPU ieee
    fla.utils.IS_TF32_SUPPORTED = TF32_DOTS
    from fla.ops.kda import chunk_kda

    print(f"fla-core {fla.__version__}, triton {triton.__version__} (interpreter), torch {torch.__version__}; "
          "error ratio x 1e-3 (in parentheses: largest absolute error <= 1e-6)")
    print("| case | dtype | seed | kernels | " + " | ".join(ORDER) + " | s |\n|---|---|---:|---|"
          + "---:|" * (len(ORDER) + 1))
    for dtype in args.dtype:
        for index in args.case:
            case = KDA_GRID[index]
            if case.split is not None:
                print(f"| {case.name} | {dtype} | | | KCP ranks: not an FLA call |")
                continue
            for seed in args.seed:
                x = make_inputs(case, getattr(torch, DTYPES[dtype]), seed)
                ref = reference(case, x)
                start = time.perf_counter()
                rows = [("FLA", lambda: fla_results(chunk_kda, case, x))]
                if args.ours:
                    rows.append(("ours (torch)", lambda: ours(case, x, "torch")))
                for kernels, run in rows:
                    found = run()
                    cells = []
                    for name in ORDER:
                        if name not in case.names:
                            cells.append("-")
                            continue
                        ratio, largest = error_ratio(found[name], ref[name])
                        cells.append(f"{ratio * 1e3:.2f}" if largest > ABS_PASS else f"({ratio * 1e3:.2f})")
                    seconds = time.perf_counter() - start
                    start = time.perf_counter()
                    print(f"| {case.name} | {dtype} | {seed} | {kernels} | " + " | ".join(cells)
                          + f" | {seconds:.0f} |", flush=True)
    print("\n| operation | operands | fla/ops/ line | count |\n|---|---|---|---:|")
    for (kind, operands, site), count in sorted(MET.items()):
        print(f"| {kind} | {operands} | {site or '-'} | {count} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
