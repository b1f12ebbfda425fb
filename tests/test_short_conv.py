"""The short convolution op (``gdn_kcp::short_conv``): the torch program
against a token-by-token fp64 loop (documents reset, the halo read by the
first document only), its gradients by gradcheck, the Triton programs under
the interpreter against the torch program, opcheck, and bad shapes."""

from __future__ import annotations

import pytest
import torch

from gdn_kcp.host.programs import use_programs
from gdn_kcp.kernels.torch import short_conv as torch_conv
from gdn_kcp.layers.short_conv import short_conv, short_conv_bwd_op, short_conv_op


def loop_conv(x, weight, bias, doc_starts, halo):
    """y[t] = silu(bias + sum_i w[:, W-1-i] x[t-i]) over the rows of t's document
    (and the halo's, before token 0, for the document that starts at 0)."""
    T, D = x.shape
    W = weight.shape[1]
    starts = [int(s) for s in doc_starts]
    out = []
    for t in range(T):
        start = max(s for s in starts if s <= t)
        acc = bias.clone() if bias is not None else x.new_zeros(D)
        for i in range(W):
            s = t - i
            if s >= start:
                acc = acc + weight[:, W - 1 - i] * x[s]
            elif start == 0 and halo is not None and s >= -halo.shape[0]:
                acc = acc + weight[:, W - 1 - i] * halo[halo.shape[0] + s]
        out.append(torch.nn.functional.silu(acc))
    return torch.stack(out) if out else x.new_zeros(0, D)


def op(x, w, b, starts, halo):
    """The op on one weight (and bias), as the lists it takes."""
    return short_conv_op(x, [w], [] if b is None else [b], starts, halo)


def case(T=23, D=5, W=4, starts=(0, 2, 3, 9, 23), halo=True, bias=True, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    return (make(T, D), make(D, W), make(D) if bias else None, torch.tensor(starts),
            make(W - 1, D) if halo else None)


@pytest.mark.parametrize("halo", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_op_matches_token_loop_and_gradcheck(halo, bias):
    x, w, b, starts, h = case(halo=halo, bias=bias)
    y = op(x, w, b, starts, h)
    assert (y - loop_conv(x, w, b, starts, h)).abs().max() < 1e-12
    leaves = [t.requires_grad_() for t in (x, w, b, h) if t is not None]

    def f(*args):
        it = iter(args)
        return op(next(it), next(it), next(it) if bias else None, starts, next(it) if halo else None)

    assert torch.autograd.gradcheck(f, leaves)
    # the gradients are those of the loop too
    grads = torch.autograd.grad((f(*leaves) * y.detach()).sum(), leaves)
    expected = torch.autograd.grad((loop_conv(x, w, b, starts, h) * y.detach()).sum(), leaves)
    for got, want in zip(grads, expected):
        assert (got - want).abs().max() < 1e-12


def test_a_document_never_reads_an_earlier_one():
    x, w, b, starts, h = case(T=12, starts=(0, 5))
    y = op(x, w, b, starts, h)
    x2 = x.clone()
    x2[:5] = 1e6  # the first document (and the halo's) change; the second must not
    h2 = h * 1e6
    assert torch.equal(op(x2, w, b, starts, h2)[5:], y[5:])


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("halo,bias,T", [(True, True, 70), (False, False, 37), (True, False, 2), (True, True, 0)])
def test_triton_programs_match_the_torch_program(dtype, tolerance, halo, bias, T):
    """Under TRITON_INTERPRET=1, D = 150 (two channel blocks, one partial), T
    over several token blocks. fp32: both sum W products in fp32 in another
    order; bf16: the outputs and gradients are rounded to bf16 (2^-8)."""
    from gdn_kcp.kernels.triton import short_conv as triton_conv

    starts = (0, 3, 4, 40) if T > 40 else (0,)
    x, w, b, s, h = case(T=T, D=150, starts=starts, halo=halo, bias=bias, dtype=dtype, seed=T)
    reach = torch_conv.conv_reach(s, T, 4, 3 if halo else 0)
    dy = torch.randn(T, 150, generator=torch.Generator().manual_seed(1)).to(dtype)
    results = []
    for programs in (torch_conv, triton_conv):
        y, dx, dw = torch.empty_like(x), torch.empty_like(x), torch.empty_like(w)
        db = torch.empty_like(b) if bias else None
        dh = torch.empty_like(h) if halo else None
        programs.short_conv_fwd(x, w, b, reach, h, y_out=y)
        programs.short_conv_bwd(dy, x, w, b, reach, h, dx_out=dx, dweight_out=dw, dbias_out=db, dhalo_out=dh)
        results.append([t for t in (y, dx, dw, db, dh) if t is not None])
    for name, ours, twin in zip(("y", "dx", "dweight", "dbias/dhalo", "dhalo"), results[1], results[0]):
        assert ours.shape == twin.shape, name
        if not twin.numel():
            continue
        scale = twin.double().abs().max().clamp_min(1e-30)
        assert ((ours.double() - twin.double()).abs().max() / scale) < tolerance, name


def test_op_on_triton_programs_matches_torch_programs():
    """The op itself on the Triton programs (interpreter) against the torch programs."""
    x, w, b, starts, h = case(T=40, D=20, dtype=torch.float32)
    leaves = [t.clone().requires_grad_() for t in (x, w, b, h)]
    outs = []
    for backend in ("torch", "triton"):
        with use_programs("cpu", backend):
            leaves = [t.detach().clone().requires_grad_() for t in leaves]
            y = op(leaves[0], leaves[1], leaves[2], starts, leaves[3])
            outs.append([y, *torch.autograd.grad(y.square().sum(), leaves)])
    for ours, twin in zip(outs[1], outs[0]):
        assert (ours - twin).abs().max() < 1e-4 * twin.abs().max()


def test_opcheck():
    x, w, b, starts, h = case(T=9, D=3, dtype=torch.float32)
    w1, w2 = w[:1].clone().requires_grad_(), w[1:].clone().requires_grad_()
    torch.library.opcheck(short_conv_op, (x.requires_grad_(), [w1, w2], [b[:1], b[1:]], starts, h))
    torch.library.opcheck(short_conv_op, (x, [w1, w2], [], starts, None))
    torch.library.opcheck(short_conv_bwd_op, (torch.randn(9, 3), x.detach(), [w.detach()], [b], starts, h))


def test_split_parameters_equal_one_joined_weight():
    """Weights and biases given per part (the layer's q, k, v) compute what one
    joined weight does, and their gradients are its gradient's parts."""
    x, w, b, starts, h = case(D=6)
    parts = [t.clone().requires_grad_() for t in (w[:2], w[2:], b[:2], b[2:])]
    y = short_conv_op(x, parts[:2], parts[2:], starts, h)
    assert torch.equal(y, op(x, w, b, starts, h))
    grads = torch.autograd.grad(y.square().sum(), parts)
    joined = [t.requires_grad_() for t in (w, b)]
    dw, db = torch.autograd.grad(op(x, *joined, starts, h).square().sum(), joined)
    assert torch.equal(torch.cat(grads[:2]), dw) and torch.equal(torch.cat(grads[2:]), db)


def test_batched_rows_are_separate_documents():
    x = torch.randn(3, 8, 4, dtype=torch.float64)
    w = torch.randn(4, 1, 4, dtype=torch.float64)
    y = short_conv(x, w, None)
    for row in range(3):
        assert torch.allclose(y[row], loop_conv(x[row], w[:, 0], None, [0], None), atol=1e-12)


def test_bad_shapes():
    x = torch.randn(1, 8, 4)
    with pytest.raises(ValueError, match=r"sum D_i = D = 4"):
        short_conv(x, torch.randn(5, 1, 4), None)
    with pytest.raises(ValueError, match=r"bias must have shape \[D\] = \[4\]"):
        short_conv(x, torch.randn(4, 1, 4), torch.randn(3))
    with pytest.raises(ValueError, match=r"halo must have shape \[W - 1, D\] = \[3, 4\]"):
        short_conv(x, torch.randn(4, 1, 4), None, torch.tensor([0]), torch.randn(2, 4))
    with pytest.raises(ValueError, match="B = 2"):
        short_conv(torch.randn(2, 8, 4), torch.randn(4, 1, 4), None, torch.tensor([0]))
