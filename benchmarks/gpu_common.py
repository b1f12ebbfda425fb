"""What the GPU check's stages share: the run's setup, seeded inputs, timing
(eager and CUDA-graph replays), relative errors and a results dict that is on
disk after every entry, so a stage stopped at its time cap keeps what it had."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Setup:
    """One run's device, shapes and size: the GPU check's (T = 32768, H_qk = 16,
    HV = 32, K = V = 128, bf16) or the dry run's (the CPU, tiny shapes)."""

    device: torch.device
    dims: tuple[int, int, int, int]  # H_qk, HV, K, V
    dtype: torch.dtype
    bounds: tuple[int, ...]
    dry: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def T(self) -> int:
        return self.bounds[-1]

    def repeats(self, **gpu) -> dict:
        """:func:`timed`'s keywords: ``gpu`` (default its own) on the GPU, one
        call and no warm-up on the dry run (its figures are not timings)."""
        return dict(repeats=1, warmup=0) if self.dry else gpu

    def truncated(self, T: int) -> tuple[int, ...]:
        """The packing's documents cut at ``T`` tokens."""
        return tuple(b for b in self.bounds if b < T) + (T,) if T < self.T else self.bounds

    @staticmethod
    def make(dry: bool) -> "Setup":
        if dry:
            return Setup(torch.device("cpu"), (1, 2, 32, 32), torch.bfloat16, (0, 40, 40, 41, 100, 150), True)
        return Setup(torch.device("cuda"), (16, 32, 128, 128), torch.bfloat16, tuple(packing(32768)), False)


class Results(dict):
    """A stage's results: every top-level assignment is written to ``path`` at
    once (a stage killed at its cap still reports what it finished)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.path.write_text(json.dumps(self, indent=2, default=str))


def packing(T: int, seed: int = 0) -> list[int]:
    """Documents of 64 to 6000 tokens (odd lengths), packed to T."""
    rng = random.Random(seed)
    bounds = [0]
    while bounds[-1] < T:
        bounds.append(min(T, bounds[-1] + rng.randint(64, 6000) | 1))
    return bounds


def capped_packings(T: int, max_docs: int, n: int, seed: int = 1) -> list[list[int]]:
    """``n`` random packings of T tokens, 1 to ``max_docs`` documents each."""
    rng = random.Random(seed)
    return [[0, *sorted(rng.randint(0, T) for _ in range(rng.randint(0, max_docs - 1))), T] for _ in range(n)]


def inputs(T, H_qk, HV, K, V, dtype, device, seed=0, B=1) -> list[torch.Tensor]:
    """q, k, v, g, beta: raw Gaussian q and k (the calls normalise them), gates
    near exp(g) = 0.98."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, T, H_qk, K, generator=gen)
    k = torch.randn(B, T, H_qk, K, generator=gen)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, generator=gen) + 4)
    beta = torch.rand(B, T, HV, generator=gen)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, g, beta)]


def leaves(setup: Setup, T: int | None = None, heads: tuple[int, int] | None = None, seed: int = 0):
    """:func:`inputs` of ``setup`` (at ``T`` tokens and ``heads`` = (H_qk, HV)
    if given) as leaves that require grad."""
    H_qk, HV, K, V = setup.dims
    H_qk, HV = heads or (H_qk, HV)
    return [x.requires_grad_() for x in inputs(T or setup.T, H_qk, HV, K, V, setup.dtype, setup.device, seed)]


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).square().mean().sqrt() / b.square().mean().sqrt().clamp_min(1e-30)).item()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats: int = 5, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()``, eager (launch overheads included)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def graph_timed(fn, device, repeats: int = 10) -> tuple[float, str]:
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph
    (how FLA's published times and the model count), and ``"cuda_graph"``; where
    the capture fails (a host sync in ``fn``, say) or off CUDA, the eager
    median and ``"eager: <why>"``."""
    if device.type != "cuda":
        return timed(fn, device, repeats=1, warmup=0), "eager: not CUDA"
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (Triton compiles and autotunes) off the capture
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as error:  # noqa: BLE001 - any capture failure falls back to eager timing, reported
        torch.cuda.synchronize()
        return timed(fn, device), f"eager: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return timed(graph.replay, device, repeats=repeats, warmup=2), "cuda_graph"


def forward_backward_ms(fn, xs, do, device, dry: bool) -> tuple[dict, str]:
    """Forward and backward milliseconds of ``fn()`` (the backward: forward +
    backward minus forward), each a CUDA-graph replay where it captures, and how
    they were timed."""
    if dry:
        with torch.no_grad():
            forward = timed(fn, device, repeats=1, warmup=0)  # the dry run: one call, no warm-up
        both = timed(lambda: torch.autograd.grad((fn() * do).sum(), xs), device, repeats=1, warmup=0)
        return {"forward": round(forward, 3), "backward": round(both - forward, 3)}, "eager: dry run"

    def no_grad_forward():
        with torch.no_grad():
            return fn()

    forward, how_f = graph_timed(no_grad_forward, device)
    both, how_b = graph_timed(lambda: torch.autograd.grad((fn() * do).sum(), xs), device)
    how = how_f if how_f != "cuda_graph" else how_b
    return {"forward": round(forward, 3), "backward": round(both - forward, 3)}, how


class CountCudaGraphs:
    """Counts CUDA graph captures (``torch.cuda.CUDAGraph.capture_begin``); a
    no-op off CUDA (``count`` stays None)."""

    def __init__(self, device: torch.device) -> None:
        self.on, self.count = device.type == "cuda", None

    def __enter__(self):
        if not self.on:
            return self
        self.count, self.original = 0, torch.cuda.CUDAGraph.capture_begin
        outer = self

        def counted(graph, *args, **kwargs):
            outer.count += 1
            return outer.original(graph, *args, **kwargs)

        torch.cuda.CUDAGraph.capture_begin = counted
        return self

    def __exit__(self, *exc):
        if self.on:
            torch.cuda.CUDAGraph.capture_begin = self.original
        return False
