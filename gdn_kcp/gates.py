"""flash-linear-attention's gate and beta keywords of ``chunk_gated_delta_rule``:

    use_gate_in_kernel=True:          g    = -exp(A_log) * softplus(g_raw + dt_bias)   (per value head)
    use_beta_sigmoid_in_kernel=True:  beta = sigmoid(beta_raw)
    allow_neg_eigval=True:            beta = 2 * sigmoid(beta_raw)   (eigenvalues of I - beta k k^T in [-1, 1];
                                      only with the sigmoid, as in flash-linear-attention)

Every program computes them as it loads g and beta (in the compute dtype), so
no gate or beta tensor is written: the ops take the raw inputs, ``[2, HV]``
gate parameters (``-exp(A_log)``, ``dt_bias``) and the beta mode. The
backward returns the raw inputs' gradients; the gate parameters' gradient
comes from ``[T, HV]`` torch reductions in the backward
(:func:`gdn_kcp.host.backward.gate_input_grads`), and autograd carries it to
A_log and dt_bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gdn_kcp.validate import check_float_dtype, check_flag, check_tensor


def check_head_vector(name: str, x: object, HV: int, device: torch.device) -> None:
    check_tensor(name, x, 1, "[HV]")
    check_float_dtype(name, x)
    if x.shape[0] != HV:
        raise ValueError(f"{name} must have shape [HV] = [{HV}], got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, q on {device}")


def check_channel_gate_params(g: torch.Tensor, A_log: object, dt_bias: object) -> None:
    """KDA's gate parameters for a gate per key channel ``g`` ``[..., HV, K]``:
    A_log of HV elements and dt_bias of HV * K, in any shape (as FLA takes
    them: its tests pass A_log as ``[1, 1, HV, 1]``), float, on g's device."""
    if g.dim() < 2:
        return  # g's own check names its shape
    HV, K = g.shape[-2:]
    for name, x, n, what in (("A_log", A_log, HV, "HV"), ("dt_bias", dt_bias, HV * K, "HV * K")):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of {what} elements, got {type(x).__name__}")
        check_float_dtype(name, x)
        if x.numel() != n:
            raise ValueError(f"{name} must have {what} = {n} elements, got shape {tuple(x.shape)}")
        if x.device != g.device:
            raise ValueError(f"{name} is on {x.device}, g on {g.device}")


@dataclass(frozen=True)
class InKernelGate:
    """The gate and beta the programs compute: A_log / dt_bias (or None) and the
    beta mode; ``channels`` = K for KDA's gate per key channel (0: per head)."""

    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    beta_sigmoid: bool
    beta_scale: float
    channels: int = 0

    def params(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``[2, HV]`` (``[2, HV, K]`` per channel) in ``dtype``: ``-exp(A_log)``
        (the same for every channel of a head) and ``dt_bias`` (0 without it),
        differentiable; None without the in-kernel gate."""
        if self.A_log is None:
            return None
        rate = -self.A_log.to(dtype).reshape(-1).exp()
        if self.channels:
            rate = rate[:, None].expand(-1, self.channels)
        bias = torch.zeros_like(rate) if self.dt_bias is None else self.dt_bias.to(dtype).reshape(rate.shape)
        return torch.stack([rate, bias])

    @property
    def beta_mode(self) -> tuple[bool, float]:
        return self.beta_sigmoid, self.beta_scale


def check_gate_flags(*, A_log, dt_bias, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                     **more_flags) -> None:
    """FLA's checks of the gate and beta keywords that GDN's and KDA's entries
    share: each flag a bool (``more_flags`` too), ``allow_neg_eigval`` only with
    the beta sigmoid, ``A_log`` / ``dt_bias`` only with the gate in kernel."""
    for name, flag in (("use_gate_in_kernel", use_gate_in_kernel),
                       ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel),
                       ("allow_neg_eigval", allow_neg_eigval), *more_flags.items()):
        check_flag(name, flag)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (as in "
                         "flash-linear-attention): it doubles the sigmoid of the raw beta")
    if not use_gate_in_kernel:
        for name, value in (("A_log", A_log), ("dt_bias", dt_bias)):
            if value is not None:
                raise ValueError(f"{name} is only read with use_gate_in_kernel=True (g is then the raw gate input)")


def gate_keywords(g, beta, *, A_log=None, dt_bias=None, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                  allow_neg_eigval=False, per_channel: bool = False) -> InKernelGate | None:
    """The checked keywords as an :class:`InKernelGate` (None when none is set).
    ``g`` ``[..., HV]`` (``[..., HV, K]`` with ``per_channel``: KDA, A_log of HV
    and dt_bias of HV * K elements) and ``beta`` ``[..., HV]`` (their own
    checks come later)."""
    check_gate_flags(A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=use_gate_in_kernel,
                     use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    if not (use_gate_in_kernel or use_beta_sigmoid_in_kernel or allow_neg_eigval):
        return None
    for name, x in (("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise TypeError(f"{name} must be a torch.Tensor [B, T, HV], got {type(x).__name__}")
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("use_gate_in_kernel=True needs A_log [HV]")
        if per_channel:
            check_channel_gate_params(g, A_log, dt_bias)
        else:
            HV = g.shape[-1]
            check_head_vector("A_log", A_log, HV, g.device)
            if dt_bias is not None:
                check_head_vector("dt_bias", dt_bias, HV, g.device)
    return InKernelGate(A_log if use_gate_in_kernel else None, dt_bias if use_gate_in_kernel else None,
                        use_beta_sigmoid_in_kernel, 2.0 if allow_neg_eigval else 1.0,
                        g.shape[-1] if per_channel and use_gate_in_kernel else 0)
