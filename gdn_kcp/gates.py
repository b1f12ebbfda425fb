"""flash-linear-attention's gate and beta keywords of ``chunk_gated_delta_rule``:

    use_gate_in_kernel=True:          g    = -exp(A_log) * softplus(g_raw + dt_bias)   (per value head)
    use_beta_sigmoid_in_kernel=True:  beta = sigmoid(beta_raw)
    allow_neg_eigval=True:            beta = 2 * beta   (eigenvalues of I - beta k k^T in [-1, 1])

Both are computed in fp32 (fp64 for fp64 inputs) by torch ops ahead of the
programs, so autograd carries the gradients to A_log, dt_bias and the raw
inputs. (Fusing them into the prep program, so no [T, HV] gate is written,
is still to do.)
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from gdn_kcp.validate import check_float_dtype, check_flag, check_tensor


def check_head_vector(name: str, x: object, HV: int, device: torch.device) -> None:
    check_tensor(name, x, 1, "[HV]")
    check_float_dtype(name, x)
    if x.shape[0] != HV:
        raise ValueError(f"{name} must have shape [HV] = [{HV}], got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, q on {device}")


def apply_gate_keywords(g, beta, *, A_log, dt_bias, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                        allow_neg_eigval):
    """``(g, beta)`` after the keywords (unchanged when none is set). ``g`` and
    ``beta`` are ``[..., HV]`` tensors (their own checks come later)."""
    for name, flag in (("use_gate_in_kernel", use_gate_in_kernel),
                       ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel),
                       ("allow_neg_eigval", allow_neg_eigval)):
        check_flag(name, flag)
    if not use_gate_in_kernel:
        for name, value in (("A_log", A_log), ("dt_bias", dt_bias)):
            if value is not None:
                raise ValueError(f"{name} is only read with use_gate_in_kernel=True (g is then the raw gate input)")
    if use_gate_in_kernel or use_beta_sigmoid_in_kernel or allow_neg_eigval:
        for name, x in (("g", g), ("beta", beta)):
            if not isinstance(x, torch.Tensor) or x.dim() == 0:
                raise TypeError(f"{name} must be a torch.Tensor [B, T, HV], got {type(x).__name__}")
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("use_gate_in_kernel=True needs A_log [HV]")
        HV = g.shape[-1]
        check_head_vector("A_log", A_log, HV, g.device)
        if dt_bias is not None:
            check_head_vector("dt_bias", dt_bias, HV, g.device)
        cdt = torch.promote_types(g.dtype, torch.float32)
        raw = g.to(cdt) if dt_bias is None else g.to(cdt) + dt_bias.to(cdt)
        g = -A_log.to(cdt).exp() * F.softplus(raw)
    if use_beta_sigmoid_in_kernel:
        beta = beta.to(torch.promote_types(beta.dtype, torch.float32)).sigmoid()
    if allow_neg_eigval:
        beta = beta * 2
    return g, beta
