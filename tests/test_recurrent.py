"""Decode programs: ``fused_recurrent_gated_delta_rule`` against the fp64 oracle
and the chunked path, FLA's call forms and errors; the Triton ``recurrent``
and ``conv_step`` programs under TRITON_INTERPRET=1 against their torch twins
(head dims off the tile grid, K = 256); the convolution step token by
token against the whole-sequence convolution."""

from __future__ import annotations

import pytest
import torch
from gdn_inputs import make_inputs, rel_rms

from gdn_kcp import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, naive_recurrence
from gdn_kcp.layers import short_conv
from gdn_kcp.recurrent import conv_step_op, decode_step_op, recurrent_op

BOUNDS = [0, 1, 1, 9, 40, 41]  # one token, zero-length, short, longer, one token
N = len(BOUNDS) - 1


def inputs(T=41, H_qk=2, HV=4, K=16, V=8, dtype=torch.float64, seed=0):
    q, k, v, g, beta = make_inputs(T, H_qk, HV, K, V, l2=False, seed=seed, dtype=dtype)
    h0 = torch.randn(N, HV, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    return q, k, v, g, beta, h0


@pytest.mark.parametrize("l2", [False, True])
def test_matches_the_oracle_over_packed_documents(l2):
    q, k, v, g, beta, h0 = inputs()
    cu = torch.tensor(BOUNDS)
    o, s = fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, scale=0.3, initial_state=h0,
                                            output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
    ref_o, ref_s = naive_recurrence(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True,
                                    use_qk_l2norm=l2, cu_seqlens=cu)
    assert (o - ref_o).abs().max() < 1e-12 and (s - ref_s).abs().max() < 1e-12
    assert s.dtype == torch.float64 and o.shape == v.shape


def test_q_and_k_in_another_dtype_than_v():
    """FLA's kernel takes fp32 q, k beside fp16 v (its own tests do): the
    operands are promoted exactly, so the call equals the fp32 call on v's
    values, its o in v's dtype."""
    q, k, v, g, beta, h0 = (x.float() for x in inputs())
    cu = torch.tensor(BOUNDS)
    v16 = v.half()
    o, s = fused_recurrent_gated_delta_rule(q, k, v16, g, beta=beta, initial_state=h0, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    ref_o, ref_s = fused_recurrent_gated_delta_rule(q, k, v16.float(), g, beta=beta, initial_state=h0,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                    cu_seqlens=cu)
    assert o.dtype == torch.float16 and torch.equal(o, ref_o.half()) and torch.equal(s, ref_s)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bounds", [[0, 0, 1], [0, 1, 1, 1]])
def test_one_token_beside_empty_documents(backend, bounds):
    """A stream of one token with zero-length documents before or after it:
    while the token's document steps, the empty ones read the stream's only
    valid row (row 0) and keep their initial state. Two key heads (more heads
    than tokens). Each program against the fp64 oracle: o, and every
    document's final state."""
    if backend == "triton":
        pytest.importorskip("triton")
    from gdn_kcp.kernels import torch as torch_programs

    programs = torch_programs
    if backend == "triton":
        from gdn_kcp.kernels import triton as programs
    n = len(bounds) - 1
    q, k, v, g, beta = make_inputs(1, 2, 4, 16, 8, l2=False, seed=5, dtype=torch.float64)
    h0 = torch.randn(n, 4, 16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    flat = [x[0].contiguous() for x in (q, k, v, g, beta)]
    o, state = torch.full_like(flat[2], float("nan")), torch.full_like(h0, float("nan"))
    programs.recurrent(*flat, None, torch.tensor(bounds), h0, 0.3, o_out=o, state_out=state, use_qk_l2norm=True,
                       beta_mode=(False, 1.0))
    ref_o, ref_s = naive_recurrence(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True,
                                    use_qk_l2norm=True, cu_seqlens=torch.tensor(bounds))
    assert (o - ref_o[0]).abs().max() < 1e-12 and (state - ref_s).abs().max() < 1e-12


def test_in_kernel_gate_and_beta_equal_the_chunked_path():
    """FLA's gate and beta keywords, V-first states and B = 3 rows: the same
    math as chunk_gated_delta_rule, to fp64 rounding."""
    torch.manual_seed(0)
    B, T, H_qk, HV, K, V = 3, 70, 1, 2, 16, 8
    q, k = torch.randn(B, T, H_qk, K, dtype=torch.float64), torch.randn(B, T, H_qk, K, dtype=torch.float64)
    v, a, b = (torch.randn(B, T, HV, d, dtype=torch.float64).squeeze(-1) for d in (V, 1, 1))
    A_log, dt_bias = torch.randn(HV, dtype=torch.float64), torch.randn(HV, dtype=torch.float64)
    h0 = torch.randn(B, HV, V, K, dtype=torch.float64)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
              state_v_first=True)
    o, s = fused_recurrent_gated_delta_rule(q, k, v, a, beta=b, **kw)
    ref_o, ref_s = chunk_gated_delta_rule(q, k, v, a, b, **kw)
    assert s.shape == (B, HV, V, K)
    assert (o - ref_o).abs().max() < 1e-10 and (s - ref_s).abs().max() < 1e-10


def test_fla_defaults_and_positional_order():
    """FLA's order (q, k, v, g, gk, gv, beta, scale, initial_state, ...): g
    None is no decay, beta None is ones; no final state unless asked."""
    q, k, v, g, beta, h0 = inputs()
    o, s = fused_recurrent_gated_delta_rule(q, k, v, None, None, None, None, 0.5, h0[:1])
    ones = torch.ones_like(g)
    ref_o, _ = naive_recurrence(q, k, v, torch.zeros_like(g), ones, scale=0.5, initial_state=h0[:1])
    assert s is None and (o - ref_o).abs().max() < 1e-12


def test_errors_name_the_argument():
    q, k, v, g, beta, h0 = inputs()
    with pytest.raises(ValueError, match="gk .* is not part of Gated DeltaNet"):
        fused_recurrent_gated_delta_rule(q, k, v, g, gk=torch.zeros(*q.shape[:2], 4, 16), beta=beta)
    with pytest.raises(ValueError, match="gv .* is not part of Gated DeltaNet"):
        fused_recurrent_gated_delta_rule(q, k, v, g, gv=torch.zeros_like(v), beta=beta)
    with pytest.raises(TypeError, match=r"fused_recurrent_gated_delta_rule\(\) got unexpected keyword arguments "
                                        r"\['chunk_sizes'\]"):
        fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, chunk_sizes=64)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, HV, K, V\] = \(5, 4, 16, 8\)"):
        fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=h0[:2], cu_seqlens=torch.tensor(BOUNDS))
    with pytest.raises(ValueError, match="use_gate_in_kernel=True needs A_log"):
        fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, use_gate_in_kernel=True)


def test_backward_is_refused_with_the_training_entry_named():
    q, k, v, g, beta, _ = inputs()
    o, _ = fused_recurrent_gated_delta_rule(q.requires_grad_(), k, v, g, beta=beta)
    with pytest.raises(NotImplementedError, match="train with gdn_kcp.chunk_gated_delta_rule"):
        o.sum().backward()


def test_compiles_with_fullgraph():
    """The entry traces whole (its ops' fakes shape the outputs)."""
    q, k, v, g, beta, h0 = inputs()
    compiled = torch.compile(fused_recurrent_gated_delta_rule, fullgraph=True, backend="aot_eager")
    o, s = compiled(q, k, v, g, beta=beta, initial_state=h0[:1], output_final_state=True)
    ref_o, ref_s = fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=h0[:1],
                                                    output_final_state=True)
    assert torch.equal(o, ref_o) and torch.equal(s, ref_s)


def test_opcheck():
    q, k, v, g, beta, h0 = inputs(dtype=torch.float32)
    T, H_qk, K = q.shape[1:]
    flat = [x[0].contiguous() for x in (q, k, v, g, beta)]
    for h in (h0.float(), None):
        args = (*flat, torch.randn(2, 4), torch.tensor(BOUNDS), h, 0.25, True, True, 2.0)
        torch.library.opcheck(recurrent_op, args, test_utils=("test_schema", "test_faketensor"))
    x, state = torch.randn(3, 12), torch.randn(3, 12, 4)
    torch.library.opcheck(conv_step_op, (x, state, torch.randn(12, 4), torch.randn(12)),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("W, bias", [(4, False), (3, True)])
def test_conv_step_token_by_token_equals_the_convolution(W, bias):
    """From a zero cache, one conv_step per token gives the whole row's
    convolution at every position, and the cache holds the last W inputs."""
    torch.manual_seed(0)
    T, D = 9, 12
    x = torch.randn(2, T, D, dtype=torch.float64)
    weight = torch.randn(D, 1, W, dtype=torch.float64)
    b = torch.randn(D, dtype=torch.float64) if bias else None
    whole = short_conv(x, weight, b)
    state = torch.zeros(2, D, W, dtype=torch.float64)
    for t in range(T):
        y, state = conv_step_op(x[:, t], state, weight[:, 0], b)
        assert (y - whole[:, t]).abs().max() < 1e-14
    assert torch.equal(state, x[:, T - W:].transpose(1, 2))


# ---- Triton twins under the interpreter ----

TWIN_CASES = {
    "fp32-K24-V40": dict(K=24, V=40, dtype=torch.float32, l2=True, gate=True, initial=True),
    "bf16-K16-V8": dict(K=16, V=8, dtype=torch.bfloat16, l2=True, gate=False, initial=False),
    "fp64-K16-V20": dict(K=16, V=20, dtype=torch.float64, l2=False, gate=True, initial=True),
    # K = 256 (FLA's layer head_dim). Value tiles are independent programs of 8 columns, so V = 40
    # (five tiles, the last cut) checks the tiling V = 512 repeats; V = 512 alone takes the
    # interpreter 2 minutes (64 tiles)
    "bf16-K256": dict(K=256, V=24, dtype=torch.bfloat16, l2=True, gate=True, initial=True),
    # KDA's decode (fused_recurrent_kda): a decay per key channel with -inf (a hard reset of that key row) and
    # -1000 entries, and beta per value channel
    "kda-fp64-K24-V40": dict(K=24, V=40, dtype=torch.float64, l2=True, gate=False, initial=True, channel=True),
    "kda-bf16-K16-V8": dict(K=16, V=8, dtype=torch.bfloat16, l2=True, gate=False, initial=False, channel=True),
}
TWIN_TOLERANCE = {torch.float64: (1e-13, 1e-13), torch.float32: (1e-6, 1e-6), torch.bfloat16: (2e-3, 1e-6)}
"""Relative RMS (o, final state) against the torch program. Both compute in
fp32 from the same inputs in another order (measured 1e-7 for the states);
bf16 o is rounded to bf16 once by each, so an element may land one bf16 step
(2^-8) apart (measured 2e-6)."""


@pytest.mark.parametrize("name", sorted(TWIN_CASES))
def test_triton_recurrent_matches_the_torch_program(name):
    pytest.importorskip("triton")
    from gdn_kcp.kernels import torch as torch_programs
    from gdn_kcp.kernels import triton as triton_programs

    case = TWIN_CASES[name]
    K, V, dtype = case["K"], case["V"], case["dtype"]
    q, k, v, g, beta, _ = inputs(T=41, H_qk=1, HV=2, K=K, V=V, dtype=dtype, seed=3)
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    gen = torch.Generator().manual_seed(4)
    h0 = torch.randn(N, 2, K, V, generator=gen, dtype=cdt) if case["initial"] else None
    gate = torch.stack([-torch.rand(2, generator=gen), torch.randn(2, generator=gen)]).to(cdt) \
        if case["gate"] else None
    if case.get("channel"):
        g = torch.nn.functional.logsigmoid(torch.randn(1, 41, 2, K, generator=gen)).to(g.dtype)
        g[0, 3, 0, :4], g[0, 20, 1, 2] = float("-inf"), -1000.0
        beta = torch.rand(1, 41, 2, V, generator=gen).to(beta.dtype)
    flat = [x[0].contiguous() for x in (q, k, v, g, beta)]
    outputs = []
    for programs in (torch_programs, triton_programs):
        o, state = torch.full_like(flat[2], float("nan")), torch.full((N, 2, K, V), float("nan"), dtype=cdt)
        programs.recurrent(*flat, gate, torch.tensor(BOUNDS), h0, 0.3, o_out=o, state_out=state,
                           use_qk_l2norm=case["l2"], beta_mode=(case["gate"], 2.0 if case["gate"] else 1.0))
        outputs.append((o, state))
    (o_ref, s_ref), (o_tri, s_tri) = outputs
    assert not o_tri.isnan().any() and not s_tri.isnan().any()
    assert torch.equal(s_tri[1], s_ref[1])  # the zero-length document: its initial state (or zeros) as it was
    o_tol, s_tol = TWIN_TOLERANCE[dtype]
    assert rel_rms(o_tri, o_ref) < o_tol and rel_rms(s_tri, s_ref) < s_tol, (rel_rms(o_tri, o_ref),
                                                                           rel_rms(s_tri, s_ref))


@pytest.mark.parametrize("dtype, W, bias", [(torch.float32, 4, True), (torch.bfloat16, 4, False),
                                            (torch.float64, 3, True)])
def test_triton_conv_step_matches_the_torch_program(dtype, W, bias):
    pytest.importorskip("triton")
    from gdn_kcp.kernels import torch as torch_programs
    from gdn_kcp.kernels import triton as triton_programs

    gen = torch.Generator().manual_seed(0)
    N_rows, D = 3, 300  # two channel blocks, the second cut
    x, state = torch.randn(N_rows, D, generator=gen).to(dtype), torch.randn(N_rows, D, W, generator=gen).to(dtype)
    weight, b = torch.randn(D, W, generator=gen).to(dtype), torch.randn(D, generator=gen).to(dtype)
    b = b if bias else None
    outputs = []
    for programs in (torch_programs, triton_programs):
        y, new = torch.empty_like(x), torch.empty_like(state)
        programs.conv_step(x, state, weight, b, y_out=y, state_out=new)
        outputs.append((y, new))
    (y_ref, s_ref), (y_tri, s_tri) = outputs
    assert torch.equal(s_tri, s_ref)  # the cache moves inputs, it computes nothing
    # the same taps summed in the same order in fp32 (fp64); bf16 y rounded once by each
    assert rel_rms(y_tri, y_ref) < {torch.bfloat16: 2e-3, torch.float32: 1e-6, torch.float64: 1e-14}[dtype]


DECODE_CASES = {
    # H_qk, HV, K, V, dtype, W, bias: GVA groups of 2 (one program of each writes the q / k window),
    # value tiles cut (V = 12: two tiles of 8), K off a power of two (masked channels)
    "fp32-gva-bias": dict(H_qk=2, HV=4, K=12, V=12, dtype=torch.float32, W=4, bias=True, initial=True),
    "bf16-w3": dict(H_qk=1, HV=2, K=16, V=8, dtype=torch.bfloat16, W=3, bias=False, initial=False),
    "fp64-gva": dict(H_qk=1, HV=3, K=8, V=20, dtype=torch.float64, W=4, bias=True, initial=True),
}


def decode_inputs(case, seed=0):
    gen = torch.Generator().manual_seed(seed)
    H_qk, HV, K, V, dtype, W = (case[n] for n in ("H_qk", "HV", "K", "V", "dtype", "W"))
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    N_rows, D = 3, 2 * H_qk * K + HV * V
    qkv, conv = torch.randn(N_rows, D, generator=gen).to(dtype), torch.randn(N_rows, D, W, generator=gen).to(dtype)
    weight, bias = torch.randn(D, W, generator=gen).to(dtype), torch.randn(D, generator=gen).to(dtype)
    a, b = torch.randn(N_rows, HV, generator=gen).to(dtype), torch.randn(N_rows, HV, generator=gen).to(dtype)
    gate = torch.stack([-torch.rand(HV, generator=gen), torch.randn(HV, generator=gen)]).to(cdt)
    h0 = torch.randn(N_rows, HV, K, V, generator=gen, dtype=cdt) if case["initial"] else None
    return qkv, conv, weight, bias if case["bias"] else None, a, b, gate, h0, cdt


def run_decode_step(programs, case, args):
    qkv, conv, weight, bias, a, b, gate, h0, cdt = args
    N_rows, HV, K, V = qkv.shape[0], case["HV"], case["K"], case["V"]
    o = torch.full((N_rows, HV, V), float("nan"), dtype=qkv.dtype)
    state = torch.full((N_rows, HV, K, V), float("nan"), dtype=cdt)
    conv_out = torch.full_like(conv, float("nan"))
    programs.decode_step(qkv, conv, weight, bias, a, b, gate, h0, 0.3, H_qk=case["H_qk"], o_out=o,
                         state_out=state, conv_state_out=conv_out, use_qk_l2norm=True, beta_mode=(True, 2.0))
    return o, state, conv_out


@pytest.mark.parametrize("name", sorted(DECODE_CASES))
def test_decode_step_is_the_convolution_then_the_recurrence(name):
    """The fused step (torch program) equals conv_step then recurrent, the
    convolution's output kept in the compute dtype between them."""
    from gdn_kcp.kernels import torch as torch_programs

    case = DECODE_CASES[name]
    args = decode_inputs(case)
    qkv, conv, weight, bias, a, b, gate, h0, cdt = args
    o, state, conv_out = run_decode_step(torch_programs, case, args)
    y, conv_ref = torch.empty(qkv.shape, dtype=cdt), torch.empty_like(conv)
    torch_programs.conv_step(qkv, conv, weight, bias, y_out=y, state_out=conv_ref)
    H_qk, HV, K, V = (case[n] for n in ("H_qk", "HV", "K", "V"))
    q, k, v = y.split([H_qk * K, H_qk * K, HV * V], dim=1)
    o_ref, s_ref = torch.empty_like(o), torch.empty_like(state)
    torch_programs.recurrent(q.reshape(-1, H_qk, K), k.reshape(-1, H_qk, K), v.reshape(-1, HV, V), a, b, gate,
                             torch.arange(qkv.shape[0] + 1), h0, 0.3, o_out=o_ref, state_out=s_ref,
                             use_qk_l2norm=True, beta_mode=(True, 2.0))
    assert torch.equal(o, o_ref) and torch.equal(state, s_ref) and torch.equal(conv_out, conv_ref)


@pytest.mark.parametrize("name", sorted(DECODE_CASES))
def test_triton_decode_step_matches_the_torch_program(name):
    """One launch computes the convolution in every program of a key head's
    group; the group's first writes the q / k window, each its v columns:
    the advanced cache equals the torch program's exactly, o and the states
    within the recurrent twin's tolerances."""
    pytest.importorskip("triton")
    from gdn_kcp.kernels import torch as torch_programs
    from gdn_kcp.kernels import triton as triton_programs

    case = DECODE_CASES[name]
    args = decode_inputs(case, seed=1)
    (o_ref, s_ref, c_ref), (o_tri, s_tri, c_tri) = (run_decode_step(p, case, args)
                                                    for p in (torch_programs, triton_programs))
    assert torch.equal(c_tri, c_ref)  # the cache moves inputs, every channel written once
    o_tol, s_tol = TWIN_TOLERANCE[case["dtype"]]
    assert rel_rms(o_tri, o_ref) < o_tol and rel_rms(s_tri, s_ref) < s_tol, (rel_rms(o_tri, o_ref),
                                                                           rel_rms(s_tri, s_ref))


def test_decode_step_opcheck():
    args = decode_inputs(DECODE_CASES["fp32-gva-bias"])
    qkv, conv, weight, bias, a, b, gate, h0, _ = args
    for h in (h0, None):
        torch.library.opcheck(decode_step_op, (qkv, conv, weight, bias, a, b, gate, h, 2, 12, 12, 0.3, True, True,
                                               2.0), test_utils=("test_schema", "test_faketensor"))
