"""Checkpointed regions around GDN (tests/test_checkpointing.py): a small model,
its step with and without ``torch.utils.checkpoint``, and the programs each
step launches."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from gdn_kcp import OptionsKcp, build_kcp_context, chunk_gated_delta_rule, gdn_kcp
from gdn_kcp.checkpointing import last_checkpoint_record

D_MODEL, H_QK, HV, K, V = 24, 1, 2, 16, 16
BOUNDS = (0, 60, 150, 230)
"""Three documents; on ranks the middle one crosses."""


class Model:
    """Projections -> GDN -> (region "later": an output projection and a relu inside the region)."""

    def __init__(self, dtype: torch.dtype, seed: int = 0, layers: int = 1, mlp: int = 0,
                 heads: tuple[int, int, int, int] = (H_QK, HV, K, V)) -> None:
        """``mlp``: the width of an MLP that closes the region ``"mlp"`` (0: none);
        ``heads``: H_qk, HV, K, V."""
        gen = torch.Generator().manual_seed(seed)
        self.heads = H_qk, n_v, d_k, d_v = heads

        # Weights and x are small dyadic numbers, so every projection is exact in any summation order: the
        # recompute's matmuls then equal the forward's bitwise whatever the BLAS does. With normal draws, 2 of 6
        # hash seeds gave every gradient one rounding apart in every form (reuse_recompute_tapes=False, which
        # launches no program in the recompute, included), while a region of GDN alone stayed bitwise.
        def dyadic(*shape, scale: float):
            return (torch.randint(-2, 3, shape, generator=gen) * scale).to(dtype)

        def weight(*shape):
            return dyadic(*shape, scale=2.0 ** -(3 + (shape[0] > 64)))

        self.layers = [dict(q=weight(D_MODEL, H_qk * d_k), k=weight(D_MODEL, H_qk * d_k),
                            v=weight(D_MODEL, n_v * d_v), a=weight(D_MODEL, n_v), b=weight(D_MODEL, n_v),
                            o=weight(n_v * d_v, D_MODEL),
                            **(dict(up=weight(n_v * d_v, mlp), down=weight(mlp, D_MODEL)) if mlp else {}))
                       for _ in range(layers)]
        self.params = [w.requires_grad_() for layer in self.layers for w in layer.values()]
        self.x = dyadic(1, BOUNDS[-1], D_MODEL, scale=0.5).requires_grad_()

    def core(self, x, layer: dict, gdn):
        (T, (H_qk, n_v, d_k, d_v)) = x.shape[1], self.heads
        q, k = (x @ layer["q"]).view(1, T, H_qk, d_k), (x @ layer["k"]).view(1, T, H_qk, d_k)
        v = (x @ layer["v"]).view(1, T, n_v, d_v)
        g = torch.nn.functional.logsigmoid(x @ layer["a"])
        beta = torch.sigmoid(x @ layer["b"])
        return gdn(q, k, v, g, beta).reshape(1, T, n_v * d_v)

    def step(self, region: str, form: str, gdn, *, x=None, retain_graph: bool = False) -> list[torch.Tensor]:
        """One forward and backward; ``form``: ``"none"``, ``"checkpoint"``
        (non-reentrant), ``"reentrant"`` or ``"nested"``. ``region``:
        ``"core"`` (the GDN call closes it), ``"later"`` (an output
        projection and a relu after it inside the region), ``"mlp"`` (an MLP
        of the model's width after it, inside the region) or ``"two"`` (two
        GDN calls in one region, the second closing it). Returns x's and the
        weights' gradients."""
        x = self.x if x is None else x
        leaves = (x, *self.params)
        for p in leaves:
            p.grad = None

        def region_fn(x, layer):
            o = self.core(x, layer, gdn)
            if region == "mlp":
                return torch.relu(o @ layer["up"]) @ layer["down"] + o @ layer["o"]
            return torch.relu(o @ layer["o"]) if region == "later" else o

        def two_fn(x):
            first = self.core(x, self.layers[0], gdn) @ self.layers[0]["o"]
            return self.core(first, self.layers[1], gdn)

        def run(fn, *args):
            if form == "none":
                return fn(*args)
            if form == "nested":
                return checkpoint(lambda *a: checkpoint(fn, *a, use_reentrant=False), *args, use_reentrant=False)
            return checkpoint(fn, *args, use_reentrant=form == "reentrant")

        y = run(two_fn, x) if region == "two" else run(region_fn, x, self.layers[0])
        if region not in ("later", "mlp"):
            y = y @ self.layers[-1]["o"]
        loss = y.float().square().sum()
        loss.backward(retain_graph=retain_graph)
        grads = [p.grad.clone() for p in leaves]
        if retain_graph:  # the graph again: its recompute runs anew
            for p in leaves:
                p.grad = None
            loss.backward()
            grads += [p.grad.clone() for p in leaves]
        return grads


def one_rank(options: OptionsKcp, save_mode: str | None = None):
    """The FLA-style entry on the whole stream, with the keywords of ``options``."""
    cu = torch.tensor(BOUNDS)

    def gdn(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                      save_mode=save_mode or options.save_mode,
                                      reuse_recompute_tapes=options.reuse_recompute_tapes,
                                      recompute_output=options.recompute_output)[0]
    return gdn


def assert_bitwise(expected: list[torch.Tensor], got: list[torch.Tensor], what: str) -> None:
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"{what}: gradient {i} differs by {(a - b).abs().max().item()}"


def run_ranks(rank: int, R: int, options_list: list[OptionsKcp], regions: tuple[str, ...],
              heads: tuple[int, int, int, int] = (H_QK, HV, K, V)) -> None:
    """On each rank: gdn_kcp on the rank's slice, each region checkpointed and
    not, bitwise the same gradients; the record says what the recompute did."""
    ctx = build_kcp_context(torch.tensor(BOUNDS))
    start, end = ctx.rank_ranges[rank]
    model = Model(torch.float64, heads=heads)
    x = model.x.detach()[:, start:end].clone().requires_grad_()
    for options in options_list:
        def gdn(q, k, v, g, beta):
            return gdn_kcp(q, k, v, g, beta, ctx, options=options)[0]
        for region in regions:
            expected = model.step(region, "none", gdn, x=x)
            got = model.step(region, "checkpoint", gdn, x=x)
            record = last_checkpoint_record()
            assert_bitwise(expected, got, f"rank {rank} of {R}, {region}, {options}")
            assert record.phase == "recompute", record
            keeps = options.reuse_tapes is True or (options.reuse_tapes == "auto" and region == "core")
            assert record.kept_tapes == keeps, record
            assert record.output_skipped == (region == "core"), record
