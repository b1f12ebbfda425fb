"""transformers' all-linear models under :func:`gdn_kcp.integrations.transformers.kcp`
on real gloo groups: the loss summed over the ranks and every parameter's
gradient summed over the ranks equal one rank's run of the whole packed
stream, fp64 throughout (the modeling module's ``torch.float32`` and the
tensor method ``.float()`` both keep fp64, so nothing is rounded to fp32 in
one place and not the other: a gradient summed over a rank's tokens in fp32
would differ from the whole stream's by fp32 rounding whatever the ops do)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from test_transformers_integration import RTOL, build, fp64_modeling, rel

from gdn_kcp import build_kcp_context
from gdn_kcp.integrations.transformers import kcp, use_gdn_kcp

# R: (document bounds, rank ranges): uneven ranges, a document crossing every
# rank; R = 3 has a rank of 2 tokens, so the convolution's 3-row halo
# reaches two ranks back
MODEL_CASES = {
    2: ((0, 37, 100), ((0, 60), (60, 100))),
    3: ((0, 30, 100), ((0, 45), (45, 47), (47, 100))),
}


@contextlib.contextmanager
def fp64_float():
    """``Tensor.float()`` of an fp64 tensor keeps it fp64 (the layers and the
    loss call the method, which :func:`fp64_modeling` cannot reach)."""
    original = torch.Tensor.float

    def float_keeping_fp64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    torch.Tensor.float = float_keeping_fp64
    try:
        yield
    finally:
        torch.Tensor.float = original


def targets(ids: torch.Tensor, bounds: tuple[int, ...]) -> torch.Tensor:
    """The next token of each token's document (``shift_labels``), -100 at a document's last token."""
    shift = torch.full_like(ids, -100)
    for a, b in zip(bounds, bounds[1:]):
        shift[0, a:b - 1] = ids[0, a + 1:b]
    return shift


def step(model, ids, shift, n_targets, **keywords):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=shift, shift_labels=shift, num_items_in_batch=n_targets, use_cache=False,
                 **keywords).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_model_on_rank(rank: int, R: int, family: str) -> None:
    bounds, ranges = MODEL_CASES[R]
    model = build(family, layer_types=["linear_attention", "linear_attention"])
    T = bounds[-1]
    ids = torch.randint(3, 64, (1, T), generator=torch.Generator().manual_seed(5))
    shift = targets(ids, bounds)
    n_targets = int((shift != -100).sum())
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    packing = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    ctx = build_kcp_context(list(bounds), rank_ranges=list(ranges))
    start, end = ctx.rank_ranges[rank]
    with fp64_modeling(family), fp64_float(), use_gdn_kcp(families=[family]):
        one_loss, one_grads = step(model, ids, shift, n_targets, **packing)
        with kcp(ctx):
            loss, grads = step(model, ids[:, start:end], shift[:, start:end], n_targets)
    dist.all_reduce(loss)
    where = (family, R, rank)
    assert rel(loss, one_loss) < RTOL, (where, float(loss), float(one_loss))
    assert set(grads) == set(one_grads) and len(one_grads) > 10, where
    assert any("conv1d" in name for name in grads), where
    for name in sorted(grads):
        dist.all_reduce(grads[name])
        assert rel(grads[name], one_grads[name]) < RTOL, (where, name, rel(grads[name], one_grads[name]))
