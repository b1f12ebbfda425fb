"""What the roofline (benchmarks/roofline.py) counts both sides' launches in:
the shape of a forward and backward, the fp32 ops of a substitution step, and
the estimate of a list of launches on the cost model of
:mod:`gdn_kcp.cost_model` (our launches: ``our_launches.py``; FLA's:
``fla_launches.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gdn_kcp.cost_model import H200, Launch, Machine, terms
from gdn_kcp.kernels.triton.compile_specs import kernel_of

import fla_kernels  # benchmarks/fla_kernels.py: FLA 0.5.1's kernel table (config_key)

SOLVE_OPS = 6
"""fp32 ops per tile element in one row step of a forward substitution
(row extraction: select, add; product: multiply, add; row insertion: select,
plus the masks)."""
BF16 = 2
F32 = 4



# ---------------------------------------------------------------- shapes

@dataclass(frozen=True)
class Shape:
    T: int = 32768
    H: int = 16  # H_qk
    HV: int = 32
    K: int = 128
    V: int = 128
    C: int = 64
    NC: int = 512  # chunks
    fragments: int = 1  # walks (documents on one rank)
    longest: int = 0  # chunks of the longest fragment (0: NC / fragments, documents of equal length)

    @property
    def chunks_per_fragment(self) -> int:
        """The steps of a walk: the longest fragment's chunks (every walk
        program of a launch waits for the longest)."""
        return self.longest or -(-self.NC // self.fragments)


def model_shape(T: int, docs: int, H: int, HV: int, K: int = 128, V: int = 128) -> Shape:
    """``T`` tokens in ``docs`` documents of lengths as equal as can be."""
    lengths = [T // docs + (i < T % docs) for i in range(docs)]
    return Shape(T=T, H=H, HV=HV, K=K, V=V, NC=sum(-(-L // 64) for L in lengths), fragments=docs,
                 longest=-(-max(lengths) // 64))


def estimate(launches: list[Launch], facts: Mapping[str, Mapping], m: Machine = H200) -> dict:
    """Rows (identical launches grouped) and the totals in ms (all, fwd, bwd)."""
    rows: dict[Launch, dict] = {}
    for launch in launches:
        if launch in rows:
            rows[launch]["n"] += 1
            continue
        f = facts.get(launch.kernel) if launch.kernel else None
        if launch.kernel and f is None:
            raise KeyError(f"no compile facts for {launch.kernel}")
        total = launch.work * launch.programs
        rows[launch] = dict(phase=launch.phase, kernel=launch.name, n=1, programs=launch.programs, steps=launch.steps,
                            products=f["products"] if f else "torch", spill_stores=f["spill_stores"] if f else 0,
                            config=fla_kernels.config_key(f["config"]) if f and "config" in f else "",
                            gflop=total.flops / 1e9, fp32_gflop=total.fp32 / 1e9, gbytes=total.bytes / 1e9,
                            **terms(launch, f, m))
    out = list(rows.values())
    ms = {p: sum(r["n"] * r["time"] for r in out if p in ("all", r["phase"])) * 1e3 for p in ("all", "fwd", "bwd")}
    return {"rows": out, "total_ms": ms["all"], "forward_ms": ms["fwd"], "backward_ms": ms["bwd"]}


def kernel_flops(launches: list[Launch]) -> dict[str, float]:
    """FLOPs of every kernel over the launches (one forward+backward): what
    ``gpu_check`` divides a kernel's measured time by for its achieved rate,
    by the name the profiler gives it (a variant's, ``name[variant]``, is its
    kernel's)."""
    out: dict[str, float] = {}
    for launch in launches:
        if launch.kernel:
            name = kernel_of(launch.kernel)
            out[name] = out.get(name, 0.0) + launch.programs * launch.work.flops
    return out
