"""The H200 cost model of one kernel launch: the time rule the segment plan
(:mod:`gdn_kcp.plan`) and the static estimate (``benchmarks/roofline.py``)
share, and its three constants fitted to measured H200 times.

A launch runs ``programs`` programs of ``work`` each (FLOPs by precision and
bytes); a walk's program is a chain of ``steps`` dependent steps of ``step``
work. With the kernel's compile facts (registers, warps, shared memory,
spill bytes per thread, the products' instruction class):

- **Residency.** ``r`` programs fit on one SM (registers in 256-register
  units per warp, shared memory plus 1 KiB per program, 64 warps, 32
  programs); ``busy = min(programs, SMs)``.
- **Compute** = the launch's FLOPs at the peaks (tensor-core products at the
  bf16 / tf32 peak when the compile shows ``wgmma`` / ``mma``, everything else
  at the fp32 peak), times :data:`COMPUTE_EFFICIENCY`'s inverse, spread over
  the busy SMs. ``mma`` (FLA's small configurations mostly compile to it) and
  ``wgmma`` (ours do) share one peak and one efficiency: an assumption the
  calibration cannot test, since its rows are FLA's.
- **Memory** = the bytes (each tile a program reads or writes once, plus its
  spills: spill stores and loads per thread, times its threads, once per
  step of a walk and once otherwise) at :data:`MEMORY_EFFICIENCY` of
  ``min(HBM, busy SMs x 64 B per clock)``. Spills are charged at that rate
  although a walk's may stay in L2: pessimistic for a spilling kernel.
- **Overlap.** Programs sharing an SM hide each other's memory time under
  their compute: ``max(compute, memory) + min(compute, memory) / co``, ``co``
  the programs one SM holds at once (``min(r, ceil(programs / busy))``); a
  lone program per SM overlaps nothing.
- **Serial** (a chain of dependent steps: a walk, a forward substitution) =
  waves x steps x the longest of: :data:`STEP_LATENCY` plus the step's work
  at one SM's rates; the step's work times the programs sharing the SM (their
  steps interleave, hiding each other's latency); the step's bytes (spills
  included) at the program's share of the bandwidth (a step's loads do not
  wait for the state, so the pipelined loop fetches them under the previous
  step).
- **Time**: a walk, whose whole work is its steps, takes its serial time;
  any other launch the larger of its overlapped and its serial time. A torch
  op between kernels streams its bytes at the memory rate. No launch
  overhead (the measured times are CUDA-graph replays).

The three constants are fitted, the same for every kernel of both
implementations, to the calibration rows of ``benchmarks/roofline.py``
(flash-linear-attention 0.5.1's measured H200 forward and backward times at
four shapes): least squares of the log ratio model / measured, by
``python benchmarks/roofline.py --fit``; ``tests/test_roofline.py`` refits
them from the committed compile facts and checks that these values are the
fit's, and that every calibration row is within 20 %.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

MEMORY_EFFICIENCY = 1.0
"""Fitted: the fraction of the HBM (and per-SM) bandwidth a kernel's loads and
stores achieve. The fit ends at its upper bound, 1: a tile the model counts
once per program that several programs read (q and k per value tile, per
value head of a key head) partly hits L2 instead."""

COMPUTE_EFFICIENCY = 0.144
"""Fitted: the fraction of the datasheet peaks a Triton kernel's counted
FLOPs achieve. Low because it also carries what the count leaves out: the
elementwise work (gates, exponentials, masks, casts) and the issue slots of
Triton's software pipelining."""

STEP_LATENCY = 0.269e-6
"""Fitted: seconds of one dependent step of a chain beyond its work (a walk
waits for its state twice a step: staged to shared memory for the tensor
cores, then the product; about 250 cycles each at 1.83 GHz)."""


@dataclass(frozen=True)
class Machine:
    """H200 SXM peaks (NVIDIA datasheet, 2024; dense = half the "with
    sparsity" figures) and the three fitted constants."""

    sms: int = 132
    bf16: float = 989e12
    tf32: float = 494e12
    fp32: float = 67e12
    hbm: float = 4.8e12
    clock: float = 1.83e9  # the clock the bf16 peak implies: 989 TFLOP/s / (132 SMs x 4096 FLOP/clk)
    sm_bytes_per_clock: float = 64  # one SM's load/store path to L2 (binds only with few programs)
    registers: int = 65536  # per SM
    shared: int = 233_472  # 228 KiB per SM, 1 KiB of it reserved per resident program
    warps: int = 64
    programs: int = 32
    memory_efficiency: float = MEMORY_EFFICIENCY
    compute_efficiency: float = COMPUTE_EFFICIENCY
    step_latency: float = STEP_LATENCY

    @property
    def sm_bandwidth(self) -> float:
        return self.sm_bytes_per_clock * self.clock


H200 = Machine()


@dataclass(frozen=True)
class Work:
    """FLOPs by precision (``bf16`` / ``tf32`` products, ``fp32`` FMA-pipe work) and bytes."""

    bf16: float = 0.0
    tf32: float = 0.0
    fp32: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def __mul__(self, n: float) -> Work:
        return Work(*(a * n for a in astuple(self)))

    @property
    def flops(self) -> float:
        return self.bf16 + self.tf32 + self.fp32


def astuple(w: Work) -> tuple[float, ...]:
    return w.bf16, w.tf32, w.fp32, w.bytes


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``programs`` programs of ``work`` each; with ``steps``,
    each program runs a chain of ``steps`` dependent steps of ``step`` work.
    ``kernel`` names its compile facts (None: a torch op, bytes only)."""

    phase: str
    kernel: str | None
    programs: int
    work: Work
    steps: int = 0
    step: Work = field(default_factory=Work)
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or self.kernel or "?"


def walk(phase: str, kernel: str, programs: int, steps: int, step: Work) -> Launch:
    """A launch of ``programs`` chains of ``steps`` dependent steps."""
    return Launch(phase, kernel, programs, step * steps, steps, step)


def resident(facts: Mapping, m: Machine = H200) -> int:
    """Programs of a kernel resident on one SM at once (registers are allocated
    in 256-register units per warp)."""
    warps = facts["num_warps"]
    per_warp = -(-facts["registers"] * 32 // 256) * 256
    limits = (m.registers // (per_warp * warps), m.shared // (facts["shared"] + 1024), m.warps // warps, m.programs)
    return max(1, min(limits))


def spill_bytes(facts: Mapping) -> int:
    """Local-memory bytes one program moves per pass of its code: its spill
    stores and loads per thread, times its threads."""
    return (facts.get("spill_stores", 0) + facts.get("spill_loads", 0)) * 32 * facts["num_warps"]


def terms(launch: Launch, facts: Mapping | None, m: Machine = H200) -> dict:
    """Compute, memory, overlapped and serial time (s) of one launch, and its
    time (the module's rule)."""
    total = launch.work * launch.programs
    if facts is None:  # a torch op: streams its bytes over the whole machine
        memory = total.bytes / (m.hbm * m.memory_efficiency)
        return {"compute": 0.0, "memory": memory, "overlapped": memory, "serial": 0.0, "time": memory,
                "resident": None, "waves": None}
    tensor = facts["products"] in ("wgmma", "mma")
    rates = tuple(rate * m.compute_efficiency for rate in
                  ((m.bf16 if tensor else m.fp32), (m.tf32 if tensor else m.fp32), m.fp32))
    busy = min(launch.programs, m.sms)
    res = resident(facts, m)
    spills = spill_bytes(facts)
    bandwidth = m.memory_efficiency * min(m.hbm, busy * m.sm_bandwidth)
    compute = sum(f / r for f, r in zip(astuple(total)[:3], rates)) * m.sms / busy
    chain = launch.steps and launch.work == launch.step * launch.steps  # a walk: all of its work is in its steps
    step_spills = spills if chain else 0  # a walk reloads its spills every step; other programs once
    memory = (total.bytes + launch.programs * (step_spills * launch.steps if chain else spills)) / bandwidth
    co = min(res, -(-launch.programs // busy))
    overlapped = max(compute, memory) + min(compute, memory) / co
    serial, waves = 0.0, None
    if launch.steps:
        in_flight = min(launch.programs, m.sms * res)
        sharing = math.ceil(in_flight / busy)  # programs sharing one SM's rates
        waves = math.ceil(launch.programs / in_flight)
        s = launch.step
        alone = m.sms * sum(f / r for f, r in zip(astuple(s)[:3], rates))  # one step's work at one SM's rates
        step_bytes = (s.bytes + step_spills) / min(m.memory_efficiency * m.sm_bandwidth / sharing,
                                                   bandwidth / in_flight)
        serial = waves * launch.steps * max(m.step_latency + alone, sharing * alone, step_bytes)
    return {"compute": compute, "memory": memory, "overlapped": overlapped, "serial": serial,
            "time": serial if chain else max(overlapped, serial), "resident": res, "waves": waves}
