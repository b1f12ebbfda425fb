"""KDA (a gate per key channel) against the fp64 naive KDA recurrence: every
output and gradient on odd sizes, GVA, states, the gate in kernel, strong
decays and hard resets; and FLA's refusals of chunk_kda's arguments."""

from __future__ import annotations

import pytest
import torch
from gdn_inputs import channel_gates, make_inputs, max_abs, random_bounds, rel_rms

from gdn_kcp import chunk_kda, kda_gate, naive_kda_recurrence

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "d_initial_state")


def kda_inputs(T, H_qk, HV, K, V, *, seed=0, dtype=torch.float64):
    q, k, v, g, beta = make_inputs(T, H_qk, HV, K, V, dtype=torch.float64, seed=seed)
    g = channel_gates(g, K, seed)
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def compare(inputs, bounds, *, l2, h0, seed=0, extra=None, gate=None, beta_fn=None, **keywords):
    """``{name: (ours, oracle)}`` for o, the final states and every gradient of a
    random loss over both. ``extra``: more leaves by keyword (A_log, dt_bias)
    whose gradients are checked too; ``gate(g, **extra)`` / ``beta_fn(beta)``:
    the oracle's gate and beta from the raw inputs."""
    extra = extra or {}
    HV, K, V = inputs[2].shape[2], inputs[0].shape[3], inputs[2].shape[3]
    N = len(bounds) - 1
    gen = torch.Generator().manual_seed(seed + 1)
    state0 = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64) * 0.5 if h0 else None
    cdt = torch.float64 if inputs[0].dtype == torch.float64 else torch.float32
    ours = [x.clone().requires_grad_() for x in [*inputs, *extra.values()]]
    refs = [x.double().requires_grad_() for x in [*inputs, *extra.values()]]
    s0 = state0.to(cdt).requires_grad_() if h0 else None
    rs0 = s0.detach().double().requires_grad_() if h0 else None
    cu = torch.tensor(bounds, dtype=torch.int32)
    o, fs = chunk_kda(*ours[:5], initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=l2,
                      cu_seqlens=cu, **keywords, **dict(zip(extra, ours[5:])))
    g_ref = refs[3] if gate is None else gate(refs[3], **dict(zip(extra, refs[5:])))
    beta_ref = refs[4] if beta_fn is None else beta_fn(refs[4])
    ro, rfs = naive_kda_recurrence(*refs[:3], g_ref, beta_ref, initial_state=rs0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
    do = torch.randn(ro.shape, generator=gen, dtype=torch.float64)
    dfs = torch.randn(rfs.shape, generator=gen, dtype=torch.float64)
    leaves, rleaves = ours + ([s0] if h0 else []), refs + ([rs0] if h0 else [])
    grads = torch.autograd.grad((o * do.to(o.dtype)).sum() + (fs * dfs.to(fs.dtype)).sum(), leaves)
    rgrads = torch.autograd.grad((ro * do).sum() + (rfs * dfs).sum(), rleaves)
    out = {"o": (o, ro), "final_state": (fs, rfs)}
    names = ["dq", "dk", "dv", "dg", "dbeta"] + [f"d{name}" for name in extra]
    out.update({n: (a, b) for n, a, b in zip(names, grads, rgrads)})
    if h0:
        out["d_initial_state"] = (grads[-1], rgrads[-1])
    return out


def assert_exact(results, where, atol=1e-9):
    for name, (ours, ref) in results.items():
        assert ours.shape == ref.shape, (where, name)
        assert torch.isfinite(ours).all(), (where, name)
        assert max_abs(ours, ref) < atol, (where, name, max_abs(ours, ref))


ODD = [  # T, K, V, H_qk, HV, documents
    (1, 16, 16, 1, 1, "one"),
    (63, 32, 100, 1, 2, "many"),
    (65, 100, 32, 2, 2, "one"),
    (130, 16, 32, 1, 4, "many"),
    (130, 128, 128, 1, 2, "two"),
]


def documents(T, kind, seed=0):
    if kind == "one":
        return [0, T]
    if kind == "two":
        return [0, T // 2 + 1, T]
    return random_bounds(T, seed, 30)


@pytest.mark.parametrize("T,K,V,H_qk,HV,docs", ODD, ids=[f"T{c[0]}-K{c[1]}-V{c[2]}-H{c[3]}x{c[4]}-{c[5]}" for c in ODD])
@pytest.mark.parametrize("l2,h0", [(True, True), (False, False)], ids=["l2-h0", "nol2-noh0"])
def test_fp64_matches_the_kda_oracle(T, K, V, H_qk, HV, docs, l2, h0):
    inputs = kda_inputs(T, H_qk, HV, K, V, seed=T + K)
    assert_exact(compare(inputs, documents(T, docs), l2=l2, h0=h0), f"T={T} K={K} V={V}")


@pytest.mark.parametrize("keywords", [{}, dict(disable_recompute=True), dict(save_mode="inverse"),
                                      dict(save_mode="full", recompute_output="always")], ids=str)
def test_every_save_mode_and_hard_resets(keywords):
    """A channel reset (-inf) on every token of one document and -1000 gates
    elsewhere: exact in every save mode (FLA's disable_recompute, and ours)."""
    inputs = kda_inputs(140, 1, 2, 32, 16, seed=3)
    inputs[3][0, 70:100, 1, 5] = float("-inf")
    inputs[3][0, 20:30, 0, :] = -1000.0
    results = compare(inputs, [0, 70, 100, 140], l2=True, h0=True, **keywords)
    assert_exact(results, str(keywords))


@pytest.mark.parametrize("lower_bound,with_A_log", [(None, True), (-5.0, True), (-2.0, False)])
def test_gate_in_kernel_and_beta_sigmoid(lower_bound, with_A_log):
    """FLA's gate in kernel (softplus form, lower-bound form with and without
    A_log) and beta = 2 sigmoid(beta): gradients reach the raw g, A_log and dt_bias."""
    T, HV, K = 90, 4, 16
    inputs = kda_inputs(T, 2, HV, K, 24, seed=5)
    inputs[3] = torch.randn(1, T, HV, K, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    gen = torch.Generator().manual_seed(10)
    A_log = torch.randn(HV, generator=gen, dtype=torch.float64)
    dt_bias = torch.randn(HV * K, generator=gen, dtype=torch.float64)
    extra = dict(A_log=A_log, dt_bias=dt_bias) if with_A_log else dict(dt_bias=dt_bias)
    keywords = dict(use_gate_in_kernel=True, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=True,
                    allow_neg_eigval=True)
    results = compare(inputs, [0, 40, T], l2=True, h0=True, extra=extra,
                      gate=lambda g, A_log=None, dt_bias=None: kda_gate(g, A_log, dt_bias, lower_bound),
                      beta_fn=lambda b: 2 * torch.sigmoid(b), **keywords)
    assert set(results) >= {f"d{name}" for name in extra}
    assert_exact(results, f"lower_bound={lower_bound} A_log={with_A_log}", atol=1e-8)


def test_fp32_matches_the_oracle():
    inputs = kda_inputs(130, 1, 2, 32, 32, seed=2, dtype=torch.float32)
    for name, (ours, ref) in compare(inputs, [0, 7, 130], l2=True, h0=True).items():
        assert rel_rms(ours, ref) < 2e-5, (name, rel_rms(ours, ref))


def test_a_head_gate_broadcast_is_gdn():
    """KDA with every channel of a head given the head's gate is GDN."""
    from gdn_kcp import chunk_gated_delta_rule

    q, k, v, g, beta = make_inputs(100, 1, 2, 16, 16, dtype=torch.float64, seed=1)
    cu = torch.tensor([0, 33, 100])
    o1, s1 = chunk_kda(q, k, v, g[..., None].expand(-1, -1, -1, 16), beta, output_final_state=True, cu_seqlens=cu)
    o2, s2 = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
    assert max_abs(o1, o2) < 1e-12 and max_abs(s1, s2) < 1e-12


def _args(T=10, H=1, HV=2, K=8, V=4):
    q, k, v, g, beta = make_inputs(T, H, HV, K, V, dtype=torch.float32, seed=0)
    return q, k, v, -torch.rand(1, T, HV, K), beta


REFUSALS = [
    (dict(g=-torch.rand(1, 10, 2)), ValueError, r"g must be a 4-d|g must have shape|\[B, T, HV, K\]"),
    (dict(g=-torch.rand(1, 10, 2, 4)), ValueError, r"g must have shape \[B, T, HV, K\]"),
    (dict(use_gate_in_kernel=True), ValueError, "needs A_log"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(3)), ValueError, r"A_log must have HV = 2 elements"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(8)), ValueError,
     r"dt_bias must have HV \* K = 16 elements"),
    (dict(A_log=torch.zeros(2)), ValueError, "A_log is only read with use_gate_in_kernel=True"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(2), lower_bound=0.5), ValueError, "lower_bound must be negative"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(2), safe_gate=True), ValueError, "needs lower_bound"),
    (dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-6.0), ValueError, r"\[-5, 0\)"),
    (dict(allow_neg_eigval=True), ValueError, "requires use_beta_sigmoid_in_kernel"),
    (dict(cp_context=object()), ValueError, "gdn_kcp.kda_kcp"),
    (dict(chunk_size=16), ValueError, r"`chunk_size` must be either 32 or 64 for KDA, got chunk_size = 16"),
    (dict(return_intermediate_states="yes"), TypeError, "return_intermediate_states must be a bool"),
    (dict(max_num_seqs=3, cu_seqlens=torch.tensor([0, 4, 10])), ValueError, "max_num_seqs = 3"),
    (dict(initial_state=torch.zeros(1, 2, 8, 4, dtype=torch.bfloat16)), TypeError, "initial_state must be float32"),
    (dict(bogus=1), TypeError, "unexpected keyword"),
    (dict(disable_recompute=True, save_mode="light"), ValueError, "disable_recompute=True keeps every tape"),
    (dict(save_mode="most"), ValueError, "save_mode"),
]


@pytest.mark.parametrize("kwargs,error,match", REFUSALS, ids=[str(i) for i in range(len(REFUSALS))])
def test_refusals_name_the_argument(kwargs, error, match):
    q, k, v, g, beta = _args()
    kwargs = dict(kwargs)
    g = kwargs.pop("g", g)
    with pytest.raises(error, match=match):
        chunk_kda(q, k, v, g, beta, **kwargs)


def test_gva_needs_a_multiple():
    q, k, v, g, beta = _args(H=2, HV=3)
    with pytest.raises(ValueError, match="multiple of H_qk"):
        chunk_kda(q, k, v, g, beta)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("per_value_beta", [False, True])
def test_fused_recurrent_kda_is_the_recurrence(per_value_beta, backend):
    """The token-by-token form against the oracle (beta per head), or against
    the recurrence written out with beta per value channel; forward only. On
    the torch programs and on the Triton step (the interpreter: what CUDA
    runs), with ``channel_gates``' hard resets and -1000 gates."""
    import contextlib

    from gdn_kcp import fused_recurrent_kda
    from gdn_kcp.host.programs import use_programs

    if backend == "triton":
        pytest.importorskip("triton")

    q, k, v, g, beta = kda_inputs(40, 1, 2, 16, 8, seed=6)
    h0 = torch.randn(2, 2, 16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    cu = torch.tensor([0, 15, 40])
    if per_value_beta:
        beta = torch.rand(1, 40, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    with use_programs("cpu", "triton") if backend == "triton" else contextlib.nullcontext():
        o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    if not per_value_beta:
        ro, rs = naive_kda_recurrence(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    else:
        qn, kn = (x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6) for x in (q, k))  # FLA's l2norm eps
        qn, kn = (x.repeat_interleave(2, dim=2)[0] for x in (qn, kn))
        outs, finals = [], []
        for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            S = h0[n].clone()
            for t in range(a, b):
                S = torch.exp(g[0, t])[..., None] * S
                S = S + kn[t][..., None] * (beta[0, t] * (v[0, t] - torch.einsum("hk,hkv->hv", kn[t], S)))[:, None]
                outs.append(16 ** -0.5 * torch.einsum("hk,hkv->hv", qn[t], S))
            finals.append(S)
        ro, rs = torch.stack(outs)[None], torch.stack(finals)
    assert max_abs(o, ro) < 1e-9 and max_abs(s, rs) < 1e-9


def test_gate_parameters_in_any_shape_of_their_size():
    """FLA takes A_log as any tensor of HV elements (its tests pass ``[1, 1, HV, 1]``)
    and dt_bias of HV * K: the same gate and gradients as ``[HV]`` / ``[HV * K]``."""
    q, k, v, g, beta = _args(T=20, HV=2, K=8)
    results = []
    for A_log in (torch.tensor([0.5, -0.3]), torch.tensor([0.5, -0.3]).view(1, 1, 2, 1)):
        A_log = A_log.clone().requires_grad_()
        dt_bias = torch.linspace(-1, 1, 16).view(2, 8).requires_grad_()
        o, _ = chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
        dA, db = torch.autograd.grad(o.square().sum(), [A_log, dt_bias])
        assert dA.shape == A_log.shape and db.shape == dt_bias.shape
        results.append((o, dA.flatten(), db.flatten()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def _gate_inputs(T=150, HV=2, K=16):
    q, k, v, _, beta = kda_inputs(T, 1, HV, K, 24, seed=4)  # V != K: o is not gate-shaped
    gen = torch.Generator().manual_seed(6)
    raw = torch.randn(1, T, HV, K, generator=gen, dtype=torch.float64)
    return [q, k, v, raw, beta, torch.randn(HV, generator=gen, dtype=torch.float64),
            torch.randn(HV * K, generator=gen, dtype=torch.float64)]


@pytest.mark.parametrize("entry", ["chunk", "kcp"])
def test_gate_in_kernel_runs_in_the_programs(entry):
    """The softplus gate in kernel through the ops' [2, HV, K] parameters
    (chunk_kda and kda_kcp) equals the gate by hand (kda_gate) ahead of the
    same call, fp64, every leaf's gradient included; the forward allocates
    no [T, HV, K] tensor around the programs (no gate)."""
    from gdn_kcp import build_kcp_context, kda_kcp
    from test_gate_keywords import NewTensors

    leaves = [x.clone().requires_grad_() for x in _gate_inputs()]
    q, k, v, raw, beta, A_log, dt_bias = leaves
    bounds = [0, 40, 40, 150]
    gate = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    with NewTensors() as seen:
        if entry == "chunk":
            o, _ = chunk_kda(q, k, v, raw, beta, cu_seqlens=torch.tensor(bounds), use_qk_l2norm_in_kernel=True, **gate)
        else:
            o, _ = kda_kcp(q, k, v, raw, beta, build_kcp_context(bounds), use_qk_l2norm_in_kernel=True, **gate)
    around = [(op, shape) for op, shape in seen.shapes if shape in ((1, 150, 2, 16), (150, 2, 16))]
    assert not around, around  # the programs work on chunk layouts [NC, HV, C, K]
    assert any(shape == (2, 2, 16) for _, shape in seen.shapes)  # the gate parameters
    ref, _ = chunk_kda(q, k, v, kda_gate(raw, A_log, dt_bias), beta, cu_seqlens=torch.tensor(bounds),
                       use_qk_l2norm_in_kernel=True)
    assert max_abs(o, ref) < 1e-12
    do = torch.randn_like(o)
    ours = torch.autograd.grad((o * do).sum(), leaves)
    expected = torch.autograd.grad((ref * do).sum(), leaves)
    for name, x, y in zip("q k v g beta A_log dt_bias".split(), ours, expected):
        assert max_abs(x, y) < 1e-11 * max(1.0, float(y.abs().max())) and x.abs().max() > 0, name


def test_gate_in_kernel_saves_no_gate():
    """What autograd keeps for the backward (saved_tensors_hooks, the caller's
    leaves left out): the gate in kernel keeps what a call on a given gate
    keeps, plus the [2, HV, K] parameters; the lower-bound form, a torch
    expression, keeps three fp32 [T, HV, K] tensors (softplus's input and
    output, and the gate) where the programs keep the raw g, the figure
    kda.py's docstring states."""
    T, HV, K = 256, 2, 32
    q, k, v, raw, beta, A_log, dt_bias = (x.float().requires_grad_() for x in _gate_inputs(T, HV, K))

    def kept(**keywords):
        storages = {}

        def pack(t):
            if t.grad_fn is not None or not t.requires_grad:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            chunk_kda(q, k, v, raw.view(1, T, HV, K), beta, use_qk_l2norm_in_kernel=True, **keywords)
        return sum(storages.values())

    unit = T * HV * K * 4
    given = kept()
    in_kernel = kept(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    expression = kept(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    assert in_kernel - given <= 2 * HV * K * 4 + 64, (in_kernel, given)
    assert expression - in_kernel >= 3 * unit - raw.nbytes - 2 * HV * K * 4 - 64, (expression, in_kernel, unit)
