"""Training steps that run the same real or under FakeTensorMode, with the
peak memory MemTracker sees: the FLA-style entry with a tensor ``cu_seqlens``,
``gdn_kcp`` on a context built from a tensor, and the layer. Under
FakeTensorMode every tensor a step makes is fake, ``cu_seqlens`` included, so
a host read anywhere on the call path raises there."""

from __future__ import annotations

import torch
from spawn import gloo_releases_tensors
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from gdn_kcp import build_kcp_context, chunk_gated_delta_rule, gdn_kcp
from gdn_kcp.layers import GatedDeltaNet

BOUNDS = [0, 50, 50, 130]
T, H_qk, HV, K, V = 130, 2, 4, 16, 16
MAX_DOCS = 5


def gdn_leaves(T_rank: int = T) -> list[torch.Tensor]:
    q, k = torch.randn(1, T_rank, H_qk, K), torch.randn(1, T_rank, H_qk, K)
    v = torch.randn(1, T_rank, HV, V)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T_rank, HV))
    beta = torch.rand(1, T_rank, HV)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def fla_step() -> None:
    q, k, v, g, beta = gdn_leaves()
    o, final_state = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor(BOUNDS),
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
    (o.sum() + final_state.sum()).backward()


def kcp_step() -> None:
    """gdn_kcp on a capped context built from a tensor (fake under FakeTensorMode)."""
    ctx = build_kcp_context(torch.tensor(BOUNDS), max_docs=MAX_DOCS, n_tokens=T)
    start, end = ctx.rank_ranges[ctx.rank]
    o, _ = gdn_kcp(*gdn_leaves(end - start), ctx, use_qk_l2norm_in_kernel=True)
    o.sum().backward()


def layer_step() -> None:
    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=32, head_dim=16, num_heads=2, num_v_heads=4)
    o, _, _ = layer(torch.randn(1, T, 32), cu_seqlens=torch.tensor(BOUNDS))
    o.sum().backward()


def layer_kcp_step() -> None:
    """The layer on this rank's range, its context built from a tensor."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=32, head_dim=16, num_heads=2, num_v_heads=4)
    ctx = build_kcp_context(torch.tensor(BOUNDS), max_docs=MAX_DOCS, n_tokens=T)
    start, end = ctx.rank_ranges[ctx.rank]
    o, _, _ = layer(torch.randn(1, end - start, 32), kcp_context=ctx)
    o.sum().backward()


STEPS = {"fla": fla_step, "kcp": kcp_step, "layer": layer_step, "layer_kcp": layer_kcp_step}


def peak(step) -> dict[str, int]:
    """MemTracker's peak of ``step`` on the CPU, by kind of memory."""
    torch.manual_seed(0)
    tracker = MemTracker()
    with tracker:
        step()
    return {str(key): value for key, value in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}


def real_and_fake_peaks(name: str) -> tuple[dict[str, int], dict[str, int]]:
    with gloo_releases_tensors():  # on ranks: what the program holds, not when gloo lets go
        real = peak(STEPS[name])
    with FakeTensorMode():
        fake = peak(STEPS[name])
    return real, fake


def check_fake_peaks_on_rank(rank: int, R: int) -> None:
    for name in ("kcp", "layer_kcp"):
        real, fake = real_and_fake_peaks(name)
        assert fake == real, (rank, name, fake, real)
