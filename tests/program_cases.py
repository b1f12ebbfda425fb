"""Every program of one backend against its torch twin, on the same inputs: the
tapes a forward writes and the gradients a backward writes."""

from __future__ import annotations

import torch
from gdn_inputs import make_inputs

from gdn_kcp.dtypes import buffer_dtype
from gdn_kcp.kernels import CHUNK_SIZE, CROSSING_IN, CROSSING_OUT, ChunkIndex
from gdn_kcp.kernels import torch as torch_programs
from gdn_kcp.kernels.chunk_index import capped_index

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


def run_programs(programs, bounds: tuple[int, ...], H_qk: int, HV: int, K: int, V: int, dtype: torch.dtype,
                 seed: int, l2: bool, crossing: bool, device: str = "cpu", capped: bool = False
                 ) -> dict[str, torch.Tensor]:
    """Run every program once, in host-path order, on documents ``bounds``
    (with ``crossing``, the first crosses in and the last crosses out; see
    :func:`build_index` for ``capped``) and return what each wrote."""
    gen = torch.Generator().manual_seed(seed)
    T = bounds[-1]
    inputs = make_inputs(T, H_qk, HV, K, V, dtype=torch.float64, seed=seed, l2=l2)
    q, k, v, g, beta = [x[0].to(device=device, dtype=dtype) for x in inputs]
    index, N = build_index(bounds, crossing, capped, device)
    cdt = torch.float64 if dtype == torch.float64 else torch.float32

    def new(*shape, pool: str = ""):
        """A buffer in the dtype of workspace pool ``pool`` (the compute dtype by default)."""
        return torch.zeros(shape, dtype=buffer_dtype(pool, dtype) if pool else cdt, device=device)

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=cdt)

    out: dict[str, torch.Tensor] = {}
    norms = dict(q_rstd=new(T, H_qk), k_rstd=new(T, H_qk)) if l2 else dict(q_rstd=None, k_rstd=None)
    out.update(A=new(T, HV, CHUNK_SIZE, pool="A"), w=new(T, HV, K, pool="w"), u=new(T, HV, V, pool="v_new"))
    programs.prep(q, k, v, g, beta, index, A_out=out["A"], w_out=out["w"], u_out=out["u"],
                  q_rstd_out=norms["q_rstd"], k_rstd_out=norms["k_rstd"])
    if l2:
        out.update(norms)
    state0 = randn(N, HV, K, V)  # rows f - n_in: with crossing, the last row is not read
    summary = new(1, HV, K, V + K)  # [S_loc | M] as one pool, written through column views
    programs.summary_walk(k, out["w"], out["u"], g, index, k_rstd=norms["k_rstd"], initial_state=state0,
                          s_loc_out=summary[..., :V], m_out=summary[..., V:])
    out["summary"] = summary
    s_in = randn(1, HV, K, V) if crossing else None
    out.update(h=new(index.n_chunks, HV, K, V, pool="h"), v_new=out["u"].clone(), final=new(N, HV, K, V))
    programs.tape_walk(k, out["w"], out["v_new"], g, index, k_rstd=norms["k_rstd"],
                       initial_state=state0, s_in=s_in, h_out=out["h"], v_new_out=out["v_new"],
                       final_state_out=out["final"])
    out["o"] = torch.zeros(T, HV, V, dtype=dtype, device=device)
    scale = K**-0.5
    programs.output(q, k, g, out["h"], out["v_new"], index, scale=scale, o_out=out["o"], **norms)

    do = torch.randn(T, HV, V, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    out["dv_local"] = new(T, HV, V, pool="dv_new")
    programs.bwd_local_dv(q, k, g, do, index, scale=scale, dv_out=out["dv_local"], **norms)
    d_final = randn(N, HV, K, V)  # rows f: with crossing, the last row is not read
    out["nu"] = new(1, HV, K, V)
    programs.adjoint_summary(q, k, out["w"], g, do, out["dv_local"], index, scale=scale,
                             d_final_state=d_final, nu_out=out["nu"], **norms)
    lam = randn(1, HV, K, V) if crossing else None
    out.update(dh=new(index.n_chunks, HV, K, V, pool="dh"), dv_new=out["dv_local"].clone(), d_initial=new(N, HV, K, V))
    programs.adjoint_walk(q, k, out["w"], g, do, out["dv_new"], index, scale=scale,
                          d_final_state=d_final, lam_out=lam, dh_out=out["dh"], dv_out=out["dv_new"],
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
