"""The demo: train a small GDN layer on synthetic packed documents on CPU, then
check one forward and backward of the trained layer against the fp64 oracle."""

from __future__ import annotations

import random
import time

import torch
from torch import nn

from gdn_kcp.checkpointing import last_checkpoint_record
from gdn_kcp.chunk import chunk_gated_delta_rule
from gdn_kcp.host.programs import count_programs
from gdn_kcp.reference import naive_recurrence


class GatedDeltaNetLayer(nn.Module):
    """Projections around :func:`chunk_gated_delta_rule` (GVA: ``H_qk`` key heads,
    ``HV`` value heads; q/k L2-normalised in the kernel)."""

    def __init__(self, d_model: int, H_qk: int, HV: int, head_k: int, head_v: int) -> None:
        super().__init__()
        self.H_qk, self.HV, self.head_k, self.head_v = H_qk, HV, head_k, head_v
        self.q_proj = nn.Linear(d_model, H_qk * head_k)
        self.k_proj = nn.Linear(d_model, H_qk * head_k)
        self.v_proj = nn.Linear(d_model, HV * head_v, bias=False)
        self.gate_proj = nn.Linear(d_model, HV)
        self.beta_proj = nn.Linear(d_model, HV)
        self.o_proj = nn.Linear(HV * head_v, d_model, bias=False)
        nn.init.constant_(self.gate_proj.bias, 3.0)  # start with slow decay: exp(g) ~ 0.95

    def gdn_inputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x ``[1, T, d_model]`` -> q, k ``[1, T, H_qk, K]``, v ``[1, T, HV, V]``, g, beta ``[1, T, HV]``."""
        T = x.shape[1]
        q = self.q_proj(x).view(1, T, self.H_qk, self.head_k)
        k = self.k_proj(x).view(1, T, self.H_qk, self.head_k)
        v = self.v_proj(x).view(1, T, self.HV, self.head_v)
        g = nn.functional.logsigmoid(self.gate_proj(x))
        beta = torch.sigmoid(self.beta_proj(x))
        return [q, k, v, g, beta]

    def core(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """The projections and the GDN call: a checkpoint region the GDN call
        closes, so its recompute keeps the tapes for the backward (docs/api.md,
        "Activation checkpointing")."""
        o, _ = chunk_gated_delta_rule(*self.gdn_inputs(x), use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
        return o

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, checkpointed: bool = False) -> torch.Tensor:
        if checkpointed:
            o = torch.utils.checkpoint.checkpoint(self.core, x, cu_seqlens, use_reentrant=False)
        else:
            o = self.core(x, cu_seqlens)
        return self.o_proj(o.flatten(2))


def saved_activation_bytes(layer: GatedDeltaNetLayer, x: torch.Tensor, cu_seqlens: torch.Tensor) -> int:
    """Bytes of the tensors the core's forward saves for its backward beyond
    the layer's parameters and x: what checkpointing the core does not keep."""
    held = {p.untyped_storage().data_ptr() for p in (*layer.parameters(), x)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in held:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer.core(x, cu_seqlens)
    return sum(saved.values())


def packed_batch(T: int, d_model: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random documents packed into T tokens; the target of each token is a fixed
    linear map of a decaying sum of its document so far (``y_t = 0.9 y_{t-1} + x_t``,
    zero before the document): it needs memory that resets at document starts."""
    rng = random.Random(seed)
    bounds = [0]
    while bounds[-1] < T:
        bounds.append(min(T, bounds[-1] + rng.randint(1, 200)))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, d_model, generator=gen)
    mix = torch.randn(d_model, d_model, generator=torch.Generator().manual_seed(1234)) / (5.3 * d_model) ** 0.5
    decayed = torch.empty_like(x)
    for t in range(T):
        carry = 0.0 if t in bounds else 0.9 * decayed[0, t - 1]
        decayed[0, t] = carry + x[0, t]
    target = decayed @ mix  # unit variance: sum of 0.9^(2j) is 5.3
    return x, target, torch.tensor(bounds, dtype=torch.int32)


def oracle_errors(layer: GatedDeltaNetLayer, x: torch.Tensor, cu_seqlens: torch.Tensor) -> dict[str, float]:
    """Max |ours - oracle| of o and of every input gradient, for the layer's
    fp32 inputs (ours in fp32, the oracle in fp64)."""
    inputs = [t.detach() for t in layer.gdn_inputs(x)]
    ours = [t.clone().requires_grad_() for t in inputs]
    ref = [t.double().requires_grad_() for t in inputs]
    o, _ = chunk_gated_delta_rule(*ours, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    ro, _ = naive_recurrence(*ref, use_qk_l2norm=True, cu_seqlens=cu_seqlens)
    do = torch.randn(ro.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    grads = torch.autograd.grad((o.double() * do).sum(), ours)
    ref_grads = torch.autograd.grad((ro * do).sum(), ref)
    names = ["o", "dq", "dk", "dv", "dg", "dbeta"]
    pairs = zip([o, *grads], [ro, *ref_grads])
    return {name: (a.double() - b).abs().max().item() for name, (a, b) in zip(names, pairs)}


def run_demo(steps: int = 60, T: int = 1024, seed: int = 0) -> None:
    torch.manual_seed(seed)
    d_model = 32
    layer = GatedDeltaNetLayer(d_model, H_qk=2, HV=4, head_k=16, head_v=16)
    opt = torch.optim.Adam(layer.parameters(), lr=3e-2)
    print(f"gdn_kcp demo: one GDN layer (H_qk=2, HV=4, K=V=16), {T} packed tokens, CPU, fp32, "
          "its projections and GDN call checkpointed")
    start = time.perf_counter()
    for step in range(steps):
        x, target, cu_seqlens = packed_batch(T, d_model, seed=step)
        with count_programs() as launched:
            loss = nn.functional.mse_loss(layer(x, cu_seqlens, checkpointed=True), target)
            opt.zero_grad()
            loss.backward()
        opt.step()
        if step % 5 == 0 or step == steps - 1:
            print(f"  step {step:3d}  loss {loss.item():.4f}  ({len(cu_seqlens) - 1} documents)")
    print(f"  {steps} training steps in {time.perf_counter() - start:.1f} s")
    record = last_checkpoint_record()
    with count_programs() as plain:
        nn.functional.mse_loss(layer(x, cu_seqlens), target).backward()
    layer.zero_grad()
    print(f"  checkpoint: the recompute {'kept the tapes' if record.kept_tapes else 'replayed'}, "
          f"{'launched no output' if record.output_skipped else 'launched the output'} ({record.reasons[0]});\n"
          f"  {sum(launched.values())} program launches a step ({sum(plain.values())} without the checkpoint), "
          f"{saved_activation_bytes(layer, x, cu_seqlens) / 1e6:.2f} MB of activations not held until the backward")

    x, _, cu_seqlens = packed_batch(T, d_model, seed=10_000)
    errors = oracle_errors(layer, x, cu_seqlens)
    print("max |chunked fp32 - naive fp64 oracle| on the trained layer:")
    print("  " + "  ".join(f"{name} {err:.1e}" for name, err in errors.items()))
