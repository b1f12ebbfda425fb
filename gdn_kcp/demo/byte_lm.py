"""The training part of the demo: a small byte-level language model with two
GatedDeltaNet layers, trained with KCP on R gloo processes, on a corpus every
machine has: the ``.py`` files of Python's own standard library, one document
each. Every step packs random pieces of the training files into one stream of
``R * T_r`` bytes, which the ranks split (documents cross ranks); a capped
context (one layout for every packing) carries the split. The held-out files
(every tenth) give the loss in bits per byte, which falls as it trains.
"""

from __future__ import annotations

import glob
import math
import os
import random
import sysconfig
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

from gdn_kcp.context import build_kcp_context
from gdn_kcp.layers import GatedDeltaNet
from gdn_kcp.parallel import check_cp_gradients

HIDDEN, LAYERS, VOCAB = 64, 2, 256
MIN_PIECE, MAX_PIECE = 48, 768
"""Bytes of a packed piece: at most T / MIN_PIECE + 1 documents per stream."""


def corpus() -> tuple[list[bytes], list[bytes]]:
    """(training, held-out) documents: the standard library's top-level .py files,
    every tenth held out."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    docs = [open(path, "rb").read() for path in files]
    docs = [doc for doc in docs if len(doc) > MIN_PIECE]
    return [d for i, d in enumerate(docs) if i % 10], [d for i, d in enumerate(docs) if i % 10 == 0]


def pack(docs: list[bytes], T: int, rng: random.Random) -> tuple[torch.Tensor, list[int]]:
    """``T`` bytes of random pieces of ``docs`` and their bounds ``[0, ..., T]``."""
    stream, bounds = bytearray(), [0]
    while len(stream) < T:
        doc = rng.choice(docs)
        length = min(rng.randint(MIN_PIECE, MAX_PIECE), len(doc), T - len(stream))
        start = rng.randint(0, len(doc) - length)
        stream += doc[start : start + length]
        bounds.append(len(stream))
    return torch.tensor(list(stream), dtype=torch.long), bounds


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.gdn = GatedDeltaNet(hidden_size=HIDDEN, head_dim=16, num_heads=2, expand_v=2)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, x, ctx):
        x = x + self.gdn(self.norm1(x), kcp_context=ctx)[0]
        return x + self.mlp(self.norm2(x))


class ByteLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens, ctx):
        x = self.embed(tokens)[None]
        for block in self.blocks:
            x = block(x, ctx)
        return self.head(self.norm(x))[0]


def rank_loss(model, stream, bounds, max_docs):
    """This rank's summed next-byte loss (nats) over targets inside a document,
    and their count."""
    ctx = build_kcp_context(bounds, max_docs=max_docs)
    start, end = ctx.rank_ranges[ctx.rank]
    logits = model(stream[start:end], ctx)
    positions = torch.arange(start, end)
    doc_ends = torch.tensor(bounds[1:])
    ends = doc_ends[torch.searchsorted(doc_ends, positions, right=True)]
    valid = positions + 1 < ends  # the next byte is in the same document
    targets = stream[(positions + 1).clamp(max=len(stream) - 1)]
    loss = F.cross_entropy(logits, targets, reduction="none")
    return (loss * valid).sum(), valid.sum()


def _train(rank: int, R: int, init_file: str, steps: int, T_rank: int, seed: int, compile: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=R)
    try:
        train, held_out = corpus()
        T = R * T_rank
        max_docs = T // MIN_PIECE + 1
        torch.manual_seed(seed)  # the same initial weights on every rank
        model = ByteLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        # one graph for every step: the capped context's caps are the only ints it holds
        run = torch.compile(model, fullgraph=True) if compile else model
        eval_rng = random.Random(seed + 1)
        evals = [pack(held_out, T, eval_rng) for _ in range(2)]
        rng = random.Random(seed)  # the same packings on every rank
        if rank == 0:
            print(f"training a {LAYERS}-layer GatedDeltaNet byte LM ({sum(p.numel() for p in model.parameters()):,} "
                  f"parameters) with KCP on {R} gloo processes: {len(train)} + {len(held_out)} held-out stdlib "
                  f"files, {T} bytes per step, {T_rank} per rank, max_docs = {max_docs}"
                  f"{', torch.compile(fullgraph=True)' if compile else ''}")
        start_time = time.perf_counter()
        for step in range(steps + 1):
            if step % max(1, steps // 6) == 0 or step == steps:
                with torch.no_grad():
                    totals = torch.zeros(2, dtype=torch.float64)
                    for stream, bounds in evals:
                        loss, count = rank_loss(run, stream, bounds, max_docs)
                        totals += torch.stack([loss.double(), count.double()])
                    dist.all_reduce(totals)
                if rank == 0:
                    bpb = float(totals[0] / totals[1]) / math.log(2)
                    print(f"  step {step:4d}  held-out {bpb:.3f} bits per byte  ({time.perf_counter() - start_time:.0f} s)",
                          flush=True)
            if step == steps:
                break
            stream, bounds = pack(train, T, rng)
            loss, count = rank_loss(run, stream, bounds, max_docs)
            total = count.double().clone()
            dist.all_reduce(total)
            optimizer.zero_grad()
            (loss / total).backward()
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)  # the step's gradient: every rank's share summed
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            if step == 0:  # once per run: every rank holds the summed gradient (the KCP ranks are the cp group)
                check_cp_gradients(model, None)
            optimizer.step()
    finally:
        dist.destroy_process_group()


def run_lm_demo(R: int = 4, steps: int = 120, T_rank: int = 256, seed: int = 0, compile: bool = False) -> None:
    """Train on R processes; rank 0 prints the held-out bits per byte. With
    ``compile``, the model runs under ``torch.compile(fullgraph=True)``."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_train, args=(R, os.path.join(tmp, "rendezvous"), steps, T_rank, seed, compile), nprocs=R,
                 join=True)
