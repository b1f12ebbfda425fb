"""Activation checkpointing around GDN: what each form launches, holds and costs.

    python benchmarks/checkpoint.py [--tokens 2048] [--repeats 3]

A block is projections -> GDN (one rank, light save mode) -> output
projection -> MLP; a model is one or two blocks. For each form of one training
step (forward, backward) the table gives the programs the step launched
(counted, ``gdn_kcp.host.programs.count_programs``), MemTracker's peak on the
CPU, the CPU time as a ratio to the light step without checkpoint (best of
``--repeats``, measured in this run), and the modelled H200 time of the
launched programs at T = 32,768, H_qk / HV = 16 / 32, K = V = 128 (the
roofline's per-program costs, ``benchmarks/roofline.py``; the programs only,
not the projections). The forms:

- no checkpoint, ``save_mode="light"`` and ``"full"``;
- the core (projections and GDN) checkpointed: ``replay`` (the recompute runs
  the forward as it ran: ``reuse_recompute_tapes=False,
  recompute_output="always"``), ``replay, no output`` (``False``) and
  ``"auto"``, which keeps the tapes in the backward's pools;
- the whole block checkpointed (the output projection and the MLP save after
  GDN): ``"auto"`` (which replays there) and ``True`` (tapes kept through the
  MLP's backward).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402
from our_launches import our_launches, plan_p, pool_element_sizes  # noqa: E402

from gdn_kcp import OptionsKcp, chunk_gated_delta_rule, last_checkpoint_record  # noqa: E402
from gdn_kcp.host.programs import count_programs  # noqa: E402

D_MODEL, H_QK, HV, HEAD = 256, 2, 4, 64

FORMS = {
    "no checkpoint, light": (None, OptionsKcp()),
    "no checkpoint, full": (None, OptionsKcp(save_mode="full")),
    "core, replay": ("core", OptionsKcp(reuse_recompute_tapes=False, recompute_output="always")),
    "core, replay, no output": ("core", OptionsKcp(reuse_recompute_tapes=False)),
    "core, auto": ("core", OptionsKcp()),
    "block, auto": ("block", OptionsKcp()),
    "block, True": ("block", OptionsKcp(reuse_recompute_tapes=True)),
}
"""Form -> (what is checkpointed: None, the core or the whole block; the GDN call's options)."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D_MODEL, 2 * H_QK * HEAD + HV * HEAD, bias=False)
        self.gates = nn.Linear(D_MODEL, 2 * HV)
        self.o_proj = nn.Linear(HV * HEAD, D_MODEL, bias=False)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

    def core(self, x: torch.Tensor, cu: torch.Tensor, options: OptionsKcp) -> torch.Tensor:
        T = x.shape[1]
        q, k, v = self.qkv(x).split([H_QK * HEAD, H_QK * HEAD, HV * HEAD], dim=-1)
        a, b = self.gates(x).chunk(2, dim=-1)
        o, _ = chunk_gated_delta_rule(
            q.view(1, T, H_QK, HEAD), k.view(1, T, H_QK, HEAD), v.view(1, T, HV, HEAD),
            nn.functional.logsigmoid(a), torch.sigmoid(b), cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
            save_mode=options.save_mode, reuse_recompute_tapes=options.reuse_recompute_tapes,
            recompute_output=options.recompute_output)
        return o.flatten(2)

    def rest(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        h = x + self.o_proj(o)
        return h + self.mlp(h)

    def forward(self, x, cu, options, region):
        if region == "block":
            return checkpoint(lambda x: self.rest(x, self.core(x, cu, options)), x, use_reentrant=False)
        o = checkpoint(self.core, x, cu, options, use_reentrant=False) if region == "core" else self.core(
            x, cu, options)
        return self.rest(x, o)


def step(blocks: nn.ModuleList, x: torch.Tensor, cu: torch.Tensor, form: str) -> None:
    region, options = FORMS[form]
    for block in blocks:
        x = block(x, cu, options, region)
    x.square().mean().backward()


def measure(layers: int, T: int, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(layers))
    x = torch.randn(1, T, D_MODEL)
    cu = torch.tensor([0, T // 3, T])
    rows = []
    for form in FORMS:
        with count_programs() as counts:
            step(blocks, x, cu, form)
        tracker = MemTracker()
        with tracker:
            step(blocks, x, cu, form)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            step(blocks, x, cu, form)
            best = min(best, time.perf_counter() - start)
        blocks.zero_grad(set_to_none=True)
        record = last_checkpoint_record()
        # a backward of kept tensors is save_mode="full"'s (its segments' summaries fold M alone)
        mode = "full" if record.kept_tapes and not record.tapes_in_workspace else FORMS[form][1].save_mode
        rows.append(dict(form=form, layers=layers, counts=Counter(counts), peak=peak, seconds=best,
                         h200_ms=modelled_ms(counts, mode)))
    return rows


def modelled_ms(counts: Counter, save_mode: str) -> float:
    """The roofline's time of the counted programs at the full shape (light
    pools' dtypes; a kept-tensor backward is ``save_mode="full"``'s)."""
    shape, ctx, options = roofline.full_shape()
    e = pool_element_sizes(ctx, shape, options)
    facts = roofline.load_facts()["ours"]
    launches = our_launches(shape, e, save_mode, plan_p(ctx, shape), programs={"bwd": tuple(counts.elements())})
    return roofline.estimate(launches, facts)["total_ms"]


def markdown(rows: list[dict]) -> str:
    base = {r["layers"]: r for r in rows if r["form"] == "no checkpoint, light"}
    lines = ["| layers | form | prep | scores | walk with output | tape walk | output | MemTracker peak (MB) "
             "| CPU time / light | H200 model (ms) |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c = r["counts"]
        lines.append(f"| {r['layers']} | {r['form']} | {c['prep']} | {c['scores']} | {c['walk_output']} "
                     f"| {c['tape_walk']} | {c['output']} | {r['peak'] / 1e6:.2f} "
                     f"| {r['seconds'] / base[r['layers']]['seconds']:.2f} | {r['h200_ms']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = [row for layers in (1, 2) for row in measure(layers, args.tokens, args.repeats)]
    print(markdown(rows))


if __name__ == "__main__":
    main()
