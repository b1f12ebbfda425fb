"""Every program of one backend against its torch twin, on the same inputs and
device: the tapes a forward writes and the gradients a backward writes. The
tests run it under Triton's interpreter; ``benchmarks/gpu_check.py`` runs it on
a GPU, where the package is all it may import."""

from __future__ import annotations

from typing import NamedTuple

import torch

from gdn_kcp.dtypes import buffer_dtype
from gdn_kcp.kernels import CHUNK_SIZE, CROSSING_IN, CROSSING_OUT, ChunkIndex
from gdn_kcp.kernels import torch as torch_programs
from gdn_kcp.kernels.chunk_index import capped_index
from gdn_kcp.kernels.precision import accumulator_dtype
from gdn_kcp.kernels.segments import segment_tables, summary_rows, table_elements


def make_inputs(
    T: int,
    H_qk: int,
    HV: int,
    K: int,
    V: int,
    *,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    l2: bool = False,
    B: int = 1,
) -> list[torch.Tensor]:
    """q, k ``[B, T, H_qk, K]``, v ``[B, T, HV, V]``, g, beta ``[B, T, HV]``.

    Without the in-kernel norm, k is given unit rows (the recurrence is only
    contractive for ``beta ||k||^2 < 2``, as in a trained model); with it, q and
    k are raw Gaussians that the kernel normalises.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = randn(B, T, H_qk, K), randn(B, T, H_qk, K)
    if not l2:
        q = q / q.norm(dim=-1, keepdim=True)
        k = k / k.norm(dim=-1, keepdim=True)
    v = randn(B, T, HV, V)
    g = torch.nn.functional.logsigmoid(randn(B, T, HV) + 4.0)  # exp(g) ~ 0.98: states live ~50 tokens
    beta = torch.sigmoid(randn(B, T, HV))
    return [x.to(dtype) for x in (q, k, v, g, beta)]


SPARE_DOCS = 2
"""Zero-length documents past the range in a capped index: sentinel rows."""


def build_index(bounds: tuple[int, ...], crossing: bool, capped: bool, device: str) -> tuple[ChunkIndex, int]:
    """The index of fragments ``bounds`` (with ``crossing``, the first crosses
    in and the last crosses out) and its number of state rows. ``capped``: the
    same fragments as the range ``[10, T + 10)`` of a stream (crossing) or
    ``[0, T)`` (not), with spare documents that become sentinel rows."""
    T, N = bounds[-1], len(bounds) - 1
    if not capped:
        flags = [0] * N
        if crossing:
            flags[0] |= CROSSING_IN
            flags[-1] |= CROSSING_OUT
        return ChunkIndex.from_fragments(bounds, frag_flags=flags, device=device), N
    shift = 10 if crossing else 0
    stream = [0] + [b + shift for b in bounds[1:-1]] + [T + 2 * shift] * (1 + SPARE_DOCS)
    index = capped_index(torch.tensor(stream, device=device), shift, T + shift, last_rank=False)
    return index, index.n_frag


class CaseSetup:
    """The inputs, index and buffer makers of one program case (shared by
    :func:`run_programs` and :func:`run_segment_programs`)."""

    def __init__(self, bounds, H_qk, HV, K, V, dtype, seed, l2, crossing, device, capped):
        self.gen = torch.Generator().manual_seed(seed)
        self.T, self.dtype, self.device = bounds[-1], dtype, device
        inputs = make_inputs(self.T, H_qk, HV, K, V, dtype=torch.float64, seed=seed, l2=l2)
        self.q, self.k, self.v, self.g, self.beta = [x[0].to(device=device, dtype=dtype) for x in inputs]
        self.index, self.N = build_index(bounds, crossing, capped, device)
        self.cdt = torch.float64 if dtype == torch.float64 else torch.float32

    def new(self, *shape, pool: str = ""):
        """A buffer in the dtype of workspace pool ``pool`` (the compute dtype by default)."""
        return torch.zeros(shape, dtype=buffer_dtype(pool, self.dtype) if pool else self.cdt, device=self.device)

    def randn(self, *shape, dtype: torch.dtype | None = None):
        """Seeded normal values in ``dtype`` (the compute dtype by default)."""
        x = torch.randn(shape, generator=self.gen, dtype=torch.float64)
        return x.to(device=self.device, dtype=dtype or self.cdt)


def run_programs(programs, bounds: tuple[int, ...], H_qk: int, HV: int, K: int, V: int, dtype: torch.dtype,
                 seed: int, l2: bool, crossing: bool, device: str = "cpu", capped: bool = False
                 ) -> dict[str, torch.Tensor]:
    """Run every program once, in host-path order, on documents ``bounds``
    (with ``crossing``, the first crosses in and the last crosses out; see
    :func:`build_index` for ``capped``) and return what each wrote."""
    case = CaseSetup(bounds, H_qk, HV, K, V, dtype, seed, l2, crossing, device, capped)
    T, q, k, v, g, beta, index, N = case.T, case.q, case.k, case.v, case.g, case.beta, case.index, case.N
    new, randn = case.new, case.randn

    out: dict[str, torch.Tensor] = {}
    norms = dict(q_rstd=new(T, H_qk), k_rstd=new(T, H_qk)) if l2 else dict(q_rstd=None, k_rstd=None)
    out.update(A=new(T, HV, CHUNK_SIZE, pool="A"), w=new(T, HV, K, pool="w"), u=new(T, HV, V, pool="v_new"))
    programs.prep(q, k, v, g, beta, index, A_out=out["A"], w_out=out["w"], u_out=out["u"],
                  q_rstd_out=norms["q_rstd"], k_rstd_out=norms["k_rstd"])
    if l2:
        out.update(norms)
    w_again, u_again = torch.zeros_like(out["w"]), torch.zeros_like(out["u"])
    programs.w_u(k, v, g, beta, out["A"], index, k_rstd=norms["k_rstd"], w_out=w_again, u_out=u_again)
    assert torch.equal(w_again, out["w"]) and torch.equal(u_again, out["u"])  # the backward of save_mode="inverse"
    state0 = randn(N, HV, K, V)  # rows f - n_in: with crossing, the last row is not read
    summary = new(1, HV, K, V + K)  # [S_loc | M] as one pool
    programs.summary_walk(k, out["w"], out["u"], g, index, k_rstd=norms["k_rstd"], initial_state=state0,
                          summary_out=summary)
    out["summary"] = summary
    s_only = new(1, HV, K, V)  # a rank whose crossing-out fragment does not cross in: S_loc alone, no M launch
    programs.summary_walk(k, out["w"], out["u"], g, index, k_rstd=norms["k_rstd"], initial_state=state0,
                          summary_out=s_only)
    assert torch.equal(s_only, summary[..., :V])
    s_in = randn(1, HV, K, V) if crossing else None
    out.update(h=new(index.n_chunks, HV, K, V, pool="h"), v_new=out["u"].clone(), final=new(N, HV, K, V))
    programs.tape_walk(k, out["w"], out["v_new"], g, index, k_rstd=norms["k_rstd"],
                       initial_state=state0, s_in=s_in, h_out=out["h"], v_new_out=out["v_new"],
                       final_state_out=out["final"])
    out["o"] = torch.zeros(T, HV, V, dtype=dtype, device=device)
    scale = K**-0.5
    programs.output(q, k, g, out["h"], out["v_new"], index, scale=scale, o_out=out["o"], **norms)
    # the forward that keeps no tape: scores, then the tape walk and the output in one walk
    out.update(scores=new(T, HV, CHUNK_SIZE, pool="scores"), o_walk=torch.zeros_like(out["o"]),
               final_walk=new(N, HV, K, V))
    programs.scores(q, k, g, index, scores_out=out["scores"], **norms)
    programs.walk_output(q, k, out["w"], out["u"], g, out["scores"], index, scale=scale, initial_state=state0,
                         s_in=s_in, o_out=out["o_walk"], final_state_out=out["final_walk"], **norms)

    do = randn(T, HV, V, dtype=dtype)
    out["dv_local"] = new(T, HV, V, pool="dv_new")
    programs.bwd_local_dv(q, k, g, do, index, scale=scale, dv_out=out["dv_local"], **norms)
    d_final = randn(N, HV, K, V)  # rows f: with crossing, the last row is not read
    out["nu"] = new(1, HV, K, V)
    programs.adjoint_summary(q, k, out["w"], g, do, out["dv_local"], index, scale=scale,
                             d_final_state=d_final, nu_out=out["nu"], **norms)
    lam = randn(1, HV, K, V) if crossing else None
    out.update(dh=new(index.n_chunks, HV, K, V, pool="dh"), dv_new=out["dv_local"].clone(), d_initial=new(N, HV, K, V))
    programs.adjoint_walk(q, k, out["w"], g, do, out["dv_new"], index, scale=scale,
                          d_final_state=d_final, lam_end=lam, dh_out=out["dh"], dv_out=out["dv_new"],
                          d_initial_state_out=out["d_initial"], **norms)
    out.update(dq_heads=new(T, HV, K, pool="dq_heads"), dk_heads=new(T, HV, K, pool="dk_heads"),
               dw=new(T, HV, K, pool="dw"), dgcum=new(T, HV))
    programs.bwd_dqkwg(q, k, g, out["h"], out["v_new"], do, out["dh"], out["dv_new"], index,
                       scale=scale, dq_out=out["dq_heads"], dk_out=out["dk_heads"], dw_out=out["dw"],
                       dg_out=out["dgcum"], **norms)
    out.update(dv=torch.zeros_like(v), dbeta=torch.zeros_like(beta))
    programs.bwd_wy(k, v, beta, g, out["A"], out["dw"], out["dv_new"], index, k_rstd=norms["k_rstd"],
                    dk_acc=out["dk_heads"], dv_out=out["dv"], dbeta_out=out["dbeta"], dg_acc=out["dgcum"])
    out["dg"] = torch.zeros_like(g)
    programs.bwd_gate_cumsum(out["dgcum"], index, dg_out=out["dg"])
    out.update(dq=torch.zeros_like(q), dk=torch.zeros_like(k))
    programs.bwd_qk_norm(out["dq_heads"], out["dk_heads"], q, k, dq_out=out["dq"], dk_out=out["dk"], **norms)
    return out


def compare_with_torch(programs, **case) -> dict[str, float]:
    """Relative max error of every written tensor against the torch twin (on
    the same device). Without crossing fragments the summaries are the
    composition's identity: exactly zero in both."""
    ours, twin = run_programs(programs, **case), run_programs(torch_programs, **case)
    errors = {}
    for name, expected in twin.items():
        if not case["crossing"] and name in ("summary", "nu"):
            assert not ours[name].any() and not expected.any(), name
            continue
        assert expected.abs().max() > 0, name  # every program writes something to compare
        scale = expected.double().abs().max()
        errors[name] = ((ours[name].double() - expected.double()).abs().max() / scale).item()
    return errors


def run_segment_programs(programs, bounds: tuple[int, ...], H_qk: int, HV: int, K: int, V: int, dtype: torch.dtype,
                         seed: int, l2: bool, crossing: bool, P: int, device: str = "cpu", capped: bool = False,
                         segmented: bool = True) -> dict[str, torch.Tensor]:
    """The programs of intra-rank segments (:mod:`gdn_kcp.kernels.segments`) in
    host-path order: phase 1 (``[S | M]`` with and without u, ``nu``), phase 2
    (the folds of the crossing fragments and the carry planes) and phase 3 (the
    tape walk and the adjoint walk over the segmented index with ``carry_in``),
    on the tapes of the torch prep and the torch local dv (the same inputs for
    every backend). ``segmented=False``: the unsegmented torch programs on the
    same inputs (summary walk, adjoint summary, the walks over ``index``), under
    the names of what they equal."""
    case = CaseSetup(bounds, H_qk, HV, K, V, dtype, seed, l2, crossing, device, capped)
    T, q, k, v, g, beta, index, N = case.T, case.q, case.k, case.v, case.g, case.beta, case.index, case.N
    new, randn = case.new, case.randn

    norms = dict(q_rstd=new(T, H_qk), k_rstd=new(T, H_qk)) if l2 else dict(q_rstd=None, k_rstd=None)
    A, w, u = new(T, HV, CHUNK_SIZE, pool="A"), new(T, HV, K, pool="w"), new(T, HV, V, pool="v_new")
    torch_programs.prep(q, k, v, g, beta, index, A_out=A, w_out=w, u_out=u, q_rstd_out=norms["q_rstd"],
                        k_rstd_out=norms["k_rstd"])
    scale = K**-0.5
    do = randn(T, HV, V, dtype=dtype)
    dv_local = new(T, HV, V, pool="dv_new")
    torch_programs.bwd_local_dv(q, k, g, do, index, scale=scale, dv_out=dv_local, **norms)
    state0, s_in = randn(N, HV, K, V), randn(1, HV, K, V) if crossing else None
    d_final, lam = randn(N, HV, K, V), randn(1, HV, K, V) if crossing else None
    host = index.frag_table.cpu()
    n_sum = summary_rows(host[3].tolist(), host[5].tolist(), P, index.max_frag_chunks, exchanges=crossing)
    tables = segment_tables(index, P, n_sum, exchanges=crossing,
                            out=torch.empty(table_elements(index.n_frag, n_sum), dtype=torch.int32, device=device))
    assert n_sum > 0 and tables.n_sum == n_sum
    rows = tables.frag_rows
    out: dict[str, torch.Tensor] = {}
    out.update(fold=new(1, HV, K, V + K), h=new(index.n_chunks, HV, K, V, pool="h"), v_new=u.clone(),
               final=new(N, HV, K, V), nu_fold=new(1, HV, K, V), dh=new(index.n_chunks, HV, K, V, pool="dh"),
               dv_new=dv_local.clone(), d_initial=new(N, HV, K, V),
               o_walk=torch.zeros(T, HV, V, dtype=dtype, device=device), final_walk=new(N, HV, K, V))
    scores = new(T, HV, CHUNK_SIZE, pool="scores")  # the walk with the output reads the torch scores
    torch_programs.scores(q, k, g, index, scores_out=scores, **norms)
    if not segmented:
        programs.summary_walk(k, w, u, g, index, k_rstd=norms["k_rstd"], initial_state=state0,
                              summary_out=out["fold"])
        programs.tape_walk(k, w, out["v_new"], g, index, k_rstd=norms["k_rstd"], initial_state=state0, s_in=s_in,
                           h_out=out["h"], v_new_out=out["v_new"], final_state_out=out["final"])
        programs.walk_output(q, k, w, u, g, scores, index, scale=scale, initial_state=state0, s_in=s_in,
                             o_out=out["o_walk"], final_state_out=out["final_walk"], **norms)
        programs.adjoint_summary(q, k, w, g, do, dv_local, index, scale=scale, d_final_state=d_final,
                                 nu_out=out["nu_fold"], **norms)
        programs.adjoint_walk(q, k, w, g, do, out["dv_new"], index, scale=scale, d_final_state=d_final,
                              lam_end=lam, dh_out=out["dh"], dv_out=out["dv_new"],
                              d_initial_state_out=out["d_initial"], **norms)
        return split_fold(out, V)
    out.update(summary_m=new(n_sum, HV, K, V + K), summary=new(n_sum, HV, K, V + K), start=new(n_sum, HV, K, V),
               nu=new(n_sum, HV, K, V), end=new(n_sum, HV, K, V))
    # phase 1
    programs.segment_summary(k, w, None, g, tables.summary, k_rstd=norms["k_rstd"], summary_out=out["summary_m"])
    programs.segment_summary(k, w, u, g, tables.summary, k_rstd=norms["k_rstd"], summary_out=out["summary"])
    # phase 2: the KCP summary of the crossing-out fragment ([S_loc | M] in one pool), then the carry plane
    programs.compose_segments(out["summary"], index, rows, P, initial_state=state0, s_in=None, start_out=None,
                              final_state_out=None, summary_out=out["fold"])
    programs.compose_segments(out["summary"], index, rows, P, initial_state=state0, s_in=s_in,
                              start_out=out["start"], final_state_out=out["final"], summary_out=None)
    # phase 3 (the walk with the output writes the final states the composition did not: from its copy)
    out["final_walk"] = out["final"].clone()
    programs.tape_walk(k, w, out["v_new"], g, tables.walk, k_rstd=norms["k_rstd"], initial_state=state0, s_in=s_in,
                       h_out=out["h"], v_new_out=out["v_new"], final_state_out=out["final"], carry_in=out["start"])
    programs.walk_output(q, k, w, u, g, scores, tables.walk, scale=scale, initial_state=state0, s_in=s_in,
                         o_out=out["o_walk"], final_state_out=out["final_walk"], carry_in=out["start"], **norms)
    # backward: phase 1, the crossing-in fragment's nu, the carry plane, phase 3
    programs.adjoint_segment_summary(q, k, w, g, do, dv_local, tables.summary, scale=scale, nu_out=out["nu"],
                                     **norms)
    programs.compose_adjoints(out["nu"], out["summary"], index, rows, P, d_final_state=d_final, lam=None,
                              end_out=None, nu_out=out["nu_fold"])
    programs.compose_adjoints(out["nu"], out["summary"], index, rows, P, d_final_state=d_final, lam=lam,
                              end_out=out["end"], nu_out=None)
    programs.adjoint_walk(q, k, w, g, do, out["dv_new"], tables.adjoint, scale=scale, d_final_state=d_final,
                          lam_end=lam, dh_out=out["dh"], dv_out=out["dv_new"], d_initial_state_out=out["d_initial"],
                          carry_in=out["end"], **norms)
    return split_fold(out, V)


def split_fold(out: dict[str, torch.Tensor], V: int) -> dict[str, torch.Tensor]:
    """``out`` with its ``[S_loc | M]`` pool as two entries (M is zero unless the fold crosses in and out)."""
    fold = out.pop("fold")
    return dict(out, s_loc=fold[..., :V], m=fold[..., V:])


def compare_segments_with_torch(programs, **case) -> dict[str, float]:
    """Relative max error of every tensor :func:`run_segment_programs` writes
    against the torch twin; a tensor the twin leaves zero (the M of a fold
    that does not cross in) must be exactly zero in both."""
    ours, twin = run_segment_programs(programs, **case), run_segment_programs(torch_programs, **case)
    errors = {}
    for name, expected in twin.items():
        if not expected.any():
            assert not ours[name].any(), name
            errors[name] = 0.0
            continue
        scale = expected.double().abs().max()
        errors[name] = ((ours[name].double() - expected.double()).abs().max() / scale).item()
    return errors


def _channel_inputs(bounds, H_qk: int, HV: int, K: int, dtype: torch.dtype, seed: int, gate: bool, l2: bool,
                    hard: bool, device: str, unit_k: bool = False):
    """The generator (for more inputs), q, k ``[T, H_qk, K]``, g ``[T, HV, K]``,
    the gate parameters, the norms and the index of the ``compare_channel_*``
    checks (see :func:`compare_channel_scores`). ``unit_k`` without ``l2``:
    k scaled by ``K^-1/2``, so the WY factors stay well conditioned."""
    T, cdt = bounds[-1], accumulator_dtype(dtype)
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(T, H_qk, K, generator=gen) for _ in range(2))
    if unit_k and not l2:
        k = k / K ** 0.5
    q, k = q.to(device, dtype), k.to(device, dtype)
    g = torch.randn(T, HV, K, generator=gen) if gate else -torch.rand(T, HV, K, generator=gen)
    if hard:
        g[10:12, 0, 3] = float("-inf")  # a hard reset of one channel inside a sub-chunk
        g[40:50, HV - 1, :] = -1000.0  # FLA's padding value across a sub-chunk boundary
    g = g.to(device, cdt)
    params = torch.stack([-torch.rand(HV, 1, generator=gen).expand(HV, K), 0.1 * torch.randn(HV, K, generator=gen)])
    params = params.to(device, cdt).contiguous() if gate else None
    rstd = [(1 / x.to(cdt).norm(dim=-1)).contiguous() if l2 else None for x in (q, k)]
    return gen, q, k, g, params, rstd, ChunkIndex.from_fragments(list(bounds), device=device)


def _channel_values(gen: torch.Generator, T: int, HV: int, V: int, dtype: torch.dtype, gate: bool, device: str):
    """v ``[T, HV, V]`` and beta ``[T, HV]`` of the ``compare_channel_*`` checks
    (beta raw for its in-kernel sigmoid when ``gate``, else in (0, 1))."""
    v = torch.randn(T, HV, V, generator=gen).to(device, dtype)
    beta = (torch.randn(T, HV, generator=gen) if gate else torch.rand(T, HV, generator=gen)).to(device, dtype)
    return v, beta


def relative_rms_errors(ours: dict[str, torch.Tensor], twin: dict[str, torch.Tensor]) -> dict[str, float]:
    """``|ours - twin| / |twin|`` (Frobenius) of each named tensor, in fp64."""
    return {name: float((ours[name].double() - x.double()).norm() / x.double().norm()) for name, x in twin.items()}


def compare_channel_prep(programs, bounds: tuple[int, ...], H_qk: int, HV: int, K: int, V: int,
                         dtype: torch.dtype, seed: int, gate: bool, l2: bool, hard: bool = False,
                         device: str = "cpu") -> dict[str, float]:
    """KDA's prep (a gate per key channel: A, W, U) of ``programs`` against the
    torch program on the same inputs (as :func:`compare_channel_scores`, with
    beta through its sigmoid when ``gate``): each tape's relative RMS error.
    Every tape starts as NaN, so an entry a program does not write fails."""
    T = bounds[-1]
    gen, q, k, g, params, rstd, index = _channel_inputs(bounds, H_qk, HV, K, dtype, seed, gate, l2, hard, device,
                                                        unit_k=True)
    v, beta = _channel_values(gen, T, HV, V, dtype, gate, device)
    outs = []
    for backend in (torch_programs, programs):
        tapes = {name: torch.full((T, HV, n), float("nan"), dtype=dtype, device=device)
                 for name, n in (("A", CHUNK_SIZE), ("w", K), ("u", V))}
        norms = [torch.full((T, H_qk), float("nan"), device=device, dtype=rstd[0].dtype) for _ in range(2)] if l2 \
            else [None, None]
        backend.prep(q, k, v, g, beta, index, gate_params=params, beta_sigmoid=gate, A_out=tapes["A"],
                     w_out=tapes["w"], u_out=tapes["u"], q_rstd_out=norms[0], k_rstd_out=norms[1])
        outs.append(tapes)
    twin, ours = outs
    return relative_rms_errors(ours, twin)


class _ChannelForward(NamedTuple):
    T: int
    cdt: torch.dtype
    gen: torch.Generator
    q: torch.Tensor
    k: torch.Tensor
    g: torch.Tensor
    params: torch.Tensor | None
    norms: list
    index: ChunkIndex
    N: int
    v: torch.Tensor
    beta: torch.Tensor
    tapes: list  # A, w, u, scores of the torch programs
    state0: torch.Tensor
    s_in: torch.Tensor


def _channel_forward(bounds, H_qk: int, HV: int, K: int, V: int, dtype: torch.dtype, seed: int, gate: bool,
                     l2: bool, hard: bool, device: str) -> _ChannelForward:
    """The inputs of :func:`compare_channel_walks` and
    :func:`compare_channel_backward` (those of :func:`compare_channel_prep`,
    an index whose first fragment crosses in and whose last crosses out,
    initial states and ``s_in``) and the torch programs' prep and scores."""
    T, cdt = bounds[-1], accumulator_dtype(dtype)
    gen, q, k, g, params, _, _ = _channel_inputs(bounds, H_qk, HV, K, dtype, seed, gate, l2, hard, device,
                                                 unit_k=True)
    index, N = build_index(bounds, crossing=True, capped=False, device=device)
    v, beta = _channel_values(gen, T, HV, V, dtype, gate, device)
    state0, s_in = (torch.randn(n, HV, K, V, generator=gen).to(device, cdt) for n in (N, 1))
    norms = [torch.empty(T, H_qk, device=device, dtype=cdt) for _ in range(2)] if l2 else [None, None]
    tapes = [torch.empty(T, HV, n, dtype=buffer_dtype(pool, dtype), device=device)
             for pool, n in (("A", CHUNK_SIZE), ("w", K), ("v_new", V), ("scores", CHUNK_SIZE))]
    torch_programs.prep(q, k, v, g, beta, index, gate_params=params, beta_sigmoid=gate, A_out=tapes[0],
                        w_out=tapes[1], u_out=tapes[2], q_rstd_out=norms[0], k_rstd_out=norms[1])
    torch_programs.scores(q, k, g, index, gate_params=params, q_rstd=norms[0], k_rstd=norms[1], scores_out=tapes[3])
    return _ChannelForward(T, cdt, gen, q, k, g, params, norms, index, N, v, beta, tapes, state0, s_in)


def formed_decays(backend, q: torch.Tensor | None, k: torch.Tensor, g: torch.Tensor, index: ChunkIndex, params,
                  q_rstd: torch.Tensor | None, k_rstd: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """KDA's walk decays as ``backend.channel_decays`` forms them (into
    buffers that start as NaN, so an entry not written fails): the walks'
    ``k_decayed``, ``q_decayed`` (None with q None) and ``chunk_decay``."""
    T, HV, K = g.shape
    cdt = accumulator_dtype(k.dtype)
    out = {"k_decayed": torch.full((T, HV, K), float("nan"), dtype=buffer_dtype("k_decayed", k.dtype),
                                   device=k.device),
           "chunk_decay": torch.full((index.n_chunks, HV, K), float("nan"), dtype=cdt, device=k.device)}
    if q is not None:
        out["q_decayed"] = torch.full_like(out["k_decayed"], float("nan"))
    backend.channel_decays(q, k, g, index, gate_params=params, q_rstd=q_rstd, k_rstd=k_rstd,
                           k_decayed_out=out["k_decayed"], q_decayed_out=out.get("q_decayed"),
                           chunk_decay_out=out["chunk_decay"])
    return out


def compare_channel_walks(programs, bounds: tuple[int, ...], H_qk: int, HV: int, K: int, V: int,
                          dtype: torch.dtype, seed: int, gate: bool, l2: bool, hard: bool = False,
                          device: str = "cpu") -> dict[str, float]:
    """KDA's two forward walks (a gate per key channel) of ``programs`` against
    the torch programs, each on the W, U (and scores) of the torch programs
    (inputs as :func:`compare_channel_prep`), with initial states, the first
    fragment crossing in from ``s_in`` and the last crossing out: the
    relative RMS error of the tape walk's chunk start states ``h``, ``v_new``
    and final states, of the walk with the output's ``o`` and final states
    (``final_walk``), of the output from each backend's own tapes
    (``o_tapes``), and of the summary walk's ``S_loc`` and ``M`` (on one
    fragment over the whole range crossing in and out: a middle rank's) and
    of the segments' phase-1 summaries ``[S | M]`` (``segments``: a summary
    row per fragment); and of the walks' decays formed once a chunk
    (:func:`formed_decays`) and the two walks, the summary walk and the
    segments' summaries reading them (``*_decayed``).
    ``h``, ``v_new``, ``o``, the summaries and the decays start as NaN, so an
    entry not written fails."""
    f = _channel_forward(bounds, H_qk, HV, K, V, dtype, seed, gate, l2, hard, device)
    T, q, k, g, params, norms, index, N, v, tapes = f.T, f.q, f.k, f.g, f.params, f.norms, f.index, f.N, f.v, f.tapes
    cdt, state0, s_in = f.cdt, f.state0, f.s_in
    # the summary walk's: one fragment over the whole range, crossing in and out (a middle rank)
    middle = ChunkIndex.from_fragments((0, T), frag_flags=[CROSSING_IN | CROSSING_OUT], device=device)
    outs = []
    for backend in (torch_programs, programs):
        h = torch.full((index.n_chunks, HV, K, V), float("nan"), dtype=buffer_dtype("h", dtype), device=device)
        v_new, final = torch.full_like(tapes[2], float("nan")), torch.zeros(N, HV, K, V, dtype=cdt, device=device)
        backend.tape_walk(k, tapes[1], tapes[2], g, index, gate_params=params, k_rstd=norms[1], initial_state=state0,
                          s_in=s_in, h_out=h, v_new_out=v_new, final_state_out=final)
        o_tapes = torch.full_like(v, float("nan"))
        backend.output(q, k, g, h, v_new, index, gate_params=params, scale=K ** -0.5, q_rstd=norms[0],
                       k_rstd=norms[1], o_out=o_tapes)
        o, final_walk = torch.full_like(v, float("nan")), torch.zeros_like(final)
        backend.walk_output(q, k, tapes[1], tapes[2], g, tapes[3], index, gate_params=params, scale=K ** -0.5,
                            q_rstd=norms[0], k_rstd=norms[1], initial_state=state0, s_in=s_in, o_out=o,
                            final_state_out=final_walk)
        summary = torch.full((1, HV, K, V + K), float("nan"), dtype=cdt, device=device)  # [S_loc | M]
        backend.summary_walk(k, tapes[1], tapes[2], g, middle, gate_params=params, k_rstd=norms[1],
                             initial_state=None, summary_out=summary)
        segments = torch.full((N, HV, K, V + K), float("nan"), dtype=cdt, device=device)  # a row per fragment
        backend.segment_summary(k, tapes[1], tapes[2], g, index, gate_params=params, k_rstd=norms[1],
                                summary_out=segments)
        outs.append({"h": h, "v_new": v_new, "final": final, "o": o, "final_walk": final_walk,
                     "S_loc": summary[..., :V], "M": summary[..., V:], "o_tapes": o_tapes, "segments": segments})
        decays = formed_decays(backend, q, k, g, index, params, norms[0], norms[1])
        got = {name: torch.full_like(outs[-1][name], float("nan")) for name in ("h", "v_new", "o")}
        got.update(final=torch.zeros_like(final), final_walk=torch.zeros_like(final))
        backend.tape_walk(k, tapes[1], tapes[2], g, index, gate_params=params, k_rstd=norms[1], initial_state=state0,
                          s_in=s_in, h_out=got["h"], v_new_out=got["v_new"], final_state_out=got["final"],
                          k_decayed=decays["k_decayed"], chunk_decay=decays["chunk_decay"])
        backend.walk_output(q, k, tapes[1], tapes[2], g, tapes[3], index, gate_params=params, scale=K ** -0.5,
                            q_rstd=norms[0], k_rstd=norms[1], initial_state=state0, s_in=s_in, o_out=got["o"],
                            final_state_out=got["final_walk"], **decays)
        got["segments"] = torch.full_like(segments, float("nan"))
        backend.segment_summary(k, tapes[1], tapes[2], g, index, gate_params=params, k_rstd=norms[1],
                                summary_out=got["segments"], k_decayed=decays["k_decayed"],
                                chunk_decay=decays["chunk_decay"])
        middle_decays = formed_decays(backend, q, k, g, middle, params, norms[0], norms[1])  # its own chunks
        summary = torch.full_like(summary, float("nan"))
        backend.summary_walk(k, tapes[1], tapes[2], g, middle, gate_params=params, k_rstd=norms[1],
                             initial_state=None, summary_out=summary, k_decayed=middle_decays["k_decayed"],
                             chunk_decay=middle_decays["chunk_decay"])
        got.update(S_loc=summary[..., :V], M=summary[..., V:])
        outs[-1].update(decays, **{f"{name}_decayed": x for name, x in got.items()})
    twin, ours = outs
    return relative_rms_errors(ours, twin)


def compare_channel_backward(programs, bounds: tuple[int, ...], H_qk: int, HV: int, K: int, V: int,
                             dtype: torch.dtype, seed: int, gate: bool, l2: bool, hard: bool = False,
                             device: str = "cpu") -> dict[str, float]:
    """KDA's backward programs (a gate per key channel) of ``programs`` against
    the torch programs, each on the torch programs' tapes (inputs as
    :func:`compare_channel_walks`): the relative RMS error of the local dv
    (``dv_local``), of the adjoint summary's ``nu`` (fragment 0 crossing in)
    and of the adjoint walk's ``dh``, ``dv_new`` and initial-state adjoints
    (``d_initial``), with final-state adjoints and ``lambda_end`` into the last
    fragment, of the segments' phase-1 ``nu`` (``segment_nu``, a summary row
    per fragment), of ``bwd_dqkwg``'s dq, dk, dw and per-channel dg (on the
    twin's dh and dv_new) and of ``bwd_wy``'s dk and dg (``dk_wy``, ``dg_wy``,
    added to zero accumulators), dv and dbeta (on the twin's dw); and of the
    adjoint walk, the adjoint summary and the segments' adjoint summaries reading the decays
    formed once a chunk from raw q (``*_decayed``). The walks start from the twin's ``dv_local``; every
    tensor but ``d_initial`` (whose crossing-in row no walk writes) and
    bwd_wy's accumulators starts as NaN, so an entry not written fails."""
    f = _channel_forward(bounds, H_qk, HV, K, V, dtype, seed, gate, l2, hard, device)
    q, k, g, params, index, N, tapes = f.q, f.k, f.g, f.params, f.index, f.N, f.tapes
    norms = dict(q_rstd=f.norms[0], k_rstd=f.norms[1])
    h = torch.empty((index.n_chunks, HV, K, V), dtype=buffer_dtype("h", dtype), device=device)
    v_new = torch.empty_like(tapes[2])
    torch_programs.tape_walk(k, tapes[1], tapes[2], g, index, gate_params=params, k_rstd=norms["k_rstd"],
                             initial_state=f.state0, s_in=f.s_in, h_out=h, v_new_out=v_new,
                             final_state_out=torch.empty_like(f.state0))
    do = torch.randn(f.T, HV, V, generator=f.gen).to(device, dtype)
    d_final, lam = (torch.randn(n, HV, K, V, generator=f.gen).to(device, f.cdt) for n in (N, 1))
    scale = K ** -0.5
    dv_local = torch.empty(f.T, HV, V, dtype=buffer_dtype("dv_new", dtype), device=device)
    torch_programs.bwd_local_dv(q, k, g, do, index, gate_params=params, scale=scale, dv_out=dv_local, **norms)
    dh, dv_new = torch.empty_like(h, dtype=buffer_dtype("dh", dtype)), torch.empty_like(dv_local)
    torch_programs.adjoint_walk(q, k, tapes[1], g, do, dv_local, index, gate_params=params, scale=scale,
                                d_final_state=d_final, lam_end=lam, dh_out=dh, dv_out=dv_new,
                                d_initial_state_out=torch.empty_like(f.state0), **norms)
    dw = torch.empty(f.T, HV, K, dtype=buffer_dtype("dw", dtype), device=device)  # bwd_wy's, from the twin
    torch_programs.bwd_dqkwg(q, k, g, h, v_new, do, dh, dv_new, index, gate_params=params, scale=scale,
                             dq_out=torch.empty_like(dw), dk_out=torch.empty_like(dw), dw_out=dw,
                             dg_out=torch.empty(f.T, HV, K, dtype=f.cdt, device=device), **norms)
    outs = []
    for backend in (torch_programs, programs):
        out = {"dv_local": torch.full_like(dv_local, float("nan")), "dv_new": torch.full_like(dv_local, float("nan")),
               "nu": torch.full((1, HV, K, V), float("nan"), dtype=f.cdt, device=device),
               "dh": torch.full_like(h, float("nan"), dtype=buffer_dtype("dh", dtype)),
               "d_initial": torch.zeros_like(f.state0)}
        backend.bwd_local_dv(q, k, g, do, index, gate_params=params, scale=scale, dv_out=out["dv_local"], **norms)
        backend.adjoint_summary(q, k, tapes[1], g, do, dv_local, index, gate_params=params, scale=scale,
                                d_final_state=d_final, nu_out=out["nu"], **norms)
        backend.adjoint_walk(q, k, tapes[1], g, do, dv_local, index, gate_params=params, scale=scale,
                             d_final_state=d_final, lam_end=lam, dh_out=out["dh"], dv_out=out["dv_new"],
                             d_initial_state_out=out["d_initial"], **norms)
        decays = formed_decays(backend, q, k, g, index, params, None, norms["k_rstd"])  # the adjoint's: raw q
        out.update(dh_decayed=torch.full_like(out["dh"], float("nan")),
                   dv_new_decayed=torch.full_like(dv_local, float("nan")), d_initial_decayed=torch.zeros_like(f.state0))
        backend.adjoint_walk(q, k, tapes[1], g, do, dv_local, index, gate_params=params, scale=scale,
                             d_final_state=d_final, lam_end=lam, dh_out=out["dh_decayed"],
                             dv_out=out["dv_new_decayed"], d_initial_state_out=out["d_initial_decayed"], **norms,
                             **decays)
        out["nu_decayed"] = torch.full_like(out["nu"], float("nan"))
        backend.adjoint_summary(q, k, tapes[1], g, do, dv_local, index, gate_params=params, scale=scale,
                                d_final_state=d_final, nu_out=out["nu_decayed"], **norms, **decays)
        out["segment_nu"] = torch.full((N, HV, K, V), float("nan"), dtype=f.cdt, device=device)
        backend.adjoint_segment_summary(q, k, tapes[1], g, do, dv_local, index, gate_params=params, scale=scale,
                                        nu_out=out["segment_nu"], **norms)
        out["segment_nu_decayed"] = torch.full_like(out["segment_nu"], float("nan"))
        backend.adjoint_segment_summary(q, k, tapes[1], g, do, dv_local, index, gate_params=params, scale=scale,
                                        nu_out=out["segment_nu_decayed"], **norms, **decays)
        for name, pool in (("dq", "dq_heads"), ("dk", "dk_heads"), ("dw", "dw"), ("dg", "")):
            out[name] = torch.full((f.T, HV, K), float("nan"), device=device,
                                   dtype=buffer_dtype(pool, dtype, channel=True) if pool else f.cdt)
        backend.bwd_dqkwg(q, k, g, h, v_new, do, dh, dv_new, index, gate_params=params, scale=scale,
                          dq_out=out["dq"], dk_out=out["dk"], dw_out=out["dw"], dg_out=out["dg"], **norms)
        # bwd_wy adds its dk and dg into accumulators: from zero, its own terms alone
        out.update(dk_wy=torch.zeros_like(out["dk"]), dg_wy=torch.zeros_like(out["dg"]),
                   dv=torch.full_like(f.v, float("nan")), dbeta=torch.full_like(f.beta, float("nan")))
        backend.bwd_wy(k, f.v, f.beta, g, tapes[0], dw, dv_new, index, gate_params=params, beta_sigmoid=gate,
                       k_rstd=norms["k_rstd"], dk_acc=out["dk_wy"], dv_out=out["dv"], dbeta_out=out["dbeta"],
                       dg_acc=out["dg_wy"])
        outs.append(out)
    twin, ours = outs
    return relative_rms_errors(ours, twin)


def compare_channel_scores(programs, bounds: tuple[int, ...], H_qk: int, HV: int, K: int, dtype: torch.dtype,
                           seed: int, gate: bool, l2: bool, hard: bool = False, device: str = "cpu") -> float:
    """KDA's scores (a gate per key channel, g ``[T, HV, K]``) of ``programs``
    against the torch program on the same inputs: the relative RMS error.
    ``gate``: FLA's gate in kernel (raw g, ``[2, HV, K]`` parameters);
    ``hard``: a ``-inf`` gate on one channel of two rows and ``-1000`` on
    every channel of ten rows. Both outputs start as NaN, so an entry a
    program does not write fails the comparison."""
    T = bounds[-1]
    gen, q, k, g, params, rstd, index = _channel_inputs(bounds, H_qk, HV, K, dtype, seed, gate, l2, hard, device)
    outs = []
    for backend in (torch_programs, programs):
        out = torch.full((T, HV, CHUNK_SIZE), float("nan"), dtype=dtype, device=device)
        backend.scores(q, k, g, index, gate_params=params, q_rstd=rstd[0], k_rstd=rstd[1], scores_out=out)
        outs.append(out)
    twin, ours = outs
    return relative_rms_errors({"scores": ours}, {"scores": twin})["scores"]
