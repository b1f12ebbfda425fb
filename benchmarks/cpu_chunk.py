"""Forward + backward time of the chunked CPU path against the naive recurrence,
measured in the same run, at T = 4096, HV = 4, K = V = 128 (fp32, one document);
and KDA's chunked path (a gate per key channel, ``chunk_kda``) against GDN's at
the same shape in the same run (the ratio KDA / GDN; the target is at most 3).

    python benchmarks/cpu_chunk.py [--tokens 4096] [--repeats 3] [--compiled]

The naive recurrence is the oracle's token loop run in fp32 with autograd; the
ratio printed is naive time / chunked time. Each figure is the best of its
calls (chunked: --repeats; naive: --repeats // 3, at least 1); on a shared
machine the single naive call is the noisy figure. ``--compiled`` also times
the chunked path under ``torch.compile`` (Inductor, fullgraph): with the
opaque ``gdn_kcp`` ops, and with the traced host path
(``gdn_kcp.trace_host_path()``, every program and pool Inductor's own),
against eager in the same run; each compile (its first call, minutes on two
cores for the traced path) is timed apart.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

import gdn_kcp
from gdn_kcp import chunk_gated_delta_rule, chunk_kda, naive_recurrence


def make_inputs(T: int, H_qk: int, HV: int, K: int, V: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, T, H_qk, K, generator=gen)
    k = torch.randn(1, T, H_qk, K, generator=gen)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, generator=gen) + 3)
    beta = torch.rand(1, T, HV, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def time_fwd_bwd(fn, inputs: list[torch.Tensor], repeats: int) -> float:
    """Best of ``repeats`` wall times of one forward and backward."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        o = fn(inputs)
        o.backward(torch.ones_like(o))
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compiled", action="store_true",
                        help="also the chunked path compiled by Inductor: opaque ops and the traced host path")
    args = parser.parse_args()
    T, H_qk, HV, K, V = args.tokens, 2, 4, 128, 128
    inputs = make_inputs(T, H_qk, HV, K, V)
    cu_seqlens = torch.tensor([0, T])

    def chunked(xs):
        return chunk_gated_delta_rule(*xs, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)[0]

    def naive(xs):
        return naive_recurrence(*xs, use_qk_l2norm=True, cu_seqlens=cu_seqlens, compute_dtype=torch.float32)[0]

    print(f"T = {T}, H_qk = {H_qk}, HV = {HV}, K = V = {K}, fp32, {torch.get_num_threads()} threads")
    naive_repeats = max(1, args.repeats // 3)  # one naive call takes tens of seconds
    t_chunk = time_fwd_bwd(chunked, inputs, args.repeats)
    t_naive = time_fwd_bwd(naive, inputs, naive_repeats)
    print(f"chunked fwd+bwd: {t_chunk * 1e3:9.1f} ms  (best of {args.repeats})")
    print(f"naive   fwd+bwd: {t_naive * 1e3:9.1f} ms  (best of {naive_repeats})")
    print(f"speed-up (naive / chunked): {t_naive / t_chunk:.1f}x")
    kda_inputs = [x.detach() for x in inputs]
    gen = torch.Generator().manual_seed(1)  # each channel's gate a multiple (0.5 to 1.5) of its head's
    kda_inputs[3] = kda_inputs[3][..., None] * (0.5 + torch.rand(K, generator=gen))
    kda_inputs = [x.requires_grad_() for x in kda_inputs]

    def kda(xs):
        return chunk_kda(*xs, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)[0]

    t_kda = time_fwd_bwd(kda, kda_inputs, args.repeats)
    print(f"KDA chunked fwd+bwd: {t_kda * 1e3:9.1f} ms  (best of {args.repeats}; KDA / GDN: {t_kda / t_chunk:.2f}x)")
    if args.compiled:
        time_compiled(chunked, inputs, args.repeats, t_chunk)


def time_compiled(chunked, inputs: list[torch.Tensor], repeats: int, t_eager: float) -> None:
    """The chunked path compiled with the opaque ops and with the traced host
    path: compile time (the first call) and the best of ``repeats`` calls."""
    for name, traced in (("opaque ops", False), ("traced host path", True)):
        torch._dynamo.reset()
        compiled = torch.compile(lambda xs: chunked(xs), fullgraph=True)
        with gdn_kcp.trace_host_path() if traced else contextlib.nullcontext():
            t_compile = time_fwd_bwd(compiled, inputs, 1)
            t_run = time_fwd_bwd(compiled, inputs, repeats)
        print(f"compiled, {name}: {t_run * 1e3:9.1f} ms  (best of {repeats}; first call {t_compile:.0f} s); "
              f"eager / compiled {t_eager / t_run:.2f}x")


if __name__ == "__main__":
    main()
