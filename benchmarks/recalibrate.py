"""Recalibrate the cost model of ``roofline.py`` from a GPU check's times.

Reads what ``benchmarks/gpu_check.py`` measured (its ``gpu_check.json``: the
calibration rows timed for ours and FLA at the shapes it ran), refits the
three constants to the FLA times alone and prints every row against the refit
model, ours held out as a prediction, naming each row the model misses by
more than 20 % and saying when the times were eager (the model assumes
CUDA-graph replays).

    python benchmarks/roofline.py --recalibrate DIR/gpu_check.json [--json]
    python benchmarks/recalibrate.py DIR/gpu_check.json [--json]

KDA's elementwise rate, which no calibration row has (the model assumes the
compute efficiency fitted on GDN's tensor-core work), is fitted apart, with
the three constants held: from the profile stage's per-kernel times of
KDA's programs, ours and FLA's on both intra paths, against the model's
per-kernel times at the shape the stage ran (``kda_elementwise``): the rate
beside the assumed one, for both sides and for each alone, every kernel
against the model at both rates, and whether KDA's ratios move.

It exits 0 with misses (they are its findings) and non-zero when no FLA time
is usable (nothing to refit: ours are then set against the committed
constants) or when the check's calibration stage left no rows (the message
names the stage's status and its error). A module of its own so that
``roofline.py`` stays the model; it imports the model from there, and
``roofline.py``'s ``main`` imports this module only when it is asked to
recalibrate (no import cycle at load time).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import (  # noqa: E402  (benchmarks/roofline.py: the model)
    FIT_RANGES, H200, KDA_SIDES, Machine, Measured, Shape, calibration_table, estimate, fit, fla_kda_estimate,
    kda_facts, kda_rows, kernel_of, load_facts, model_shape, our_kda_shape_launches, prediction_table,
    warn_if_stale, with_elementwise)

MISS_LIMIT = 0.20
"""A row whose model misses its measurement by more than this is named (the
bound ``roofline.CALIBRATION`` is held to)."""

PHASES = ("forward", "backward")
TIMINGS = ("cuda_graph", "eager")
IMPLEMENTATIONS = {"fla": "FLA", "gdn_kcp": "ours"}
"""The calibration row keys ``<key>_ms`` the recalibration reads, and their names in its report."""


class NoCalibration(ValueError):
    """The check holds no calibration rows because its calibration stage did
    not run them (not run, failed, timed out, skipped): a finding of the GPU
    run, reported as a message rather than a traceback."""


@dataclass(frozen=True)
class CheckRow:
    """One calibration row of ``gpu_check.json``: the shape it stands for
    (``label``), the shape it ran (H, HV, T, K: tiny on a dry run, and the
    model is evaluated there), how it was timed, each implementation's
    measured ms by phase and why an implementation's time is missing."""

    label: str
    H: int
    HV: int
    T: int
    K: int
    timing: str
    measured: Mapping[str, Mapping[str, float]]
    errors: Mapping[str, str]


def headline(error: str) -> str:
    """The line of a stage's ``error`` that says what went wrong: its first
    line, except for a Python traceback, whose first line is always
    "Traceback (most recent call last):": there the first line of the last
    exception (the first unindented line after the last frame)."""
    lines = [line for line in error.splitlines() if line.strip()]
    if not lines:
        return ""
    if lines[0].startswith("Traceback"):
        frames = [i for i, line in enumerate(lines) if line[:1].isspace()]
        if frames and frames[-1] + 1 < len(lines):
            return lines[frames[-1] + 1]
    return lines[0]


def calibration_results(check: object) -> Mapping:
    """The calibration stage's results in a GPU check's JSON: in the layout
    ``gpu_check.py`` writes, ``check["stages"]["calibration"]["results"]``
    (its ``calibration`` rows and ``fla_error``); in the older flat layout
    (a top-level ``"calibration"``) the check itself. A stage with rows is
    read whatever its status (each row was written when it was measured); one
    without rows is a :class:`NoCalibration` naming its status and the
    headline of its error."""
    if not isinstance(check, Mapping) or "stages" not in check:
        return check
    stages = check["stages"]
    if not isinstance(stages, Mapping):
        raise ValueError(f"the GPU check's 'stages' = {stages!r}: expected an object")
    stage = stages.get("calibration")
    if stage is None:
        raise NoCalibration(f"the GPU check did not run its calibration stage (it ran: {', '.join(stages) or 'none'})")
    if not isinstance(stage, Mapping):
        raise ValueError(f"the GPU check's stages['calibration'] = {stage!r}: expected an object")
    results = stage.get("results")
    if isinstance(results, Mapping) and isinstance(results.get("calibration"), list) and results["calibration"]:
        return results
    error = headline(stage["error"]) if isinstance(stage.get("error"), str) else ""
    raise NoCalibration(f"the GPU check's calibration stage has no rows (status {stage.get('status')!r}"
                        + (f": {error})" if error else ")"))


def _positive_int(row: Mapping, key: str, where: str, default: int | None = None) -> int:
    """``row[key]`` (``default`` where absent) as a positive int, or a
    ValueError naming the key and the value."""
    value = row.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}[{key!r}] = {value!r}: expected a positive integer")
    return value


def _measured_ms(times: object, where: str) -> tuple[dict[str, float], str | None]:
    """The positive times of ``times`` (``{"forward": ms, "backward": ms}``) by
    phase, and why a phase is left out: an eager backward is forward+backward
    less the forward, which noise can bring to zero or below. A phase that is
    missing or not a number is a ValueError naming it."""
    if not isinstance(times, Mapping):
        raise ValueError(f"{where} = {times!r}: expected {{'forward': ms, 'backward': ms}}")
    usable, unusable = {}, []
    for phase in PHASES:
        value = times.get(phase)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{where}[{phase!r}] = {value!r}: expected a time in ms")
        if value > 0:
            usable[phase] = float(value)
        else:
            unusable.append(f"{phase} {value} ms")
    return usable, "not positive: " + ", ".join(unusable) if unusable else None


def check_rows(check: object) -> list[CheckRow]:
    """The calibration rows of a GPU check's JSON (either layout:
    :func:`calibration_results`), checked: ``H_qk``, ``HV`` and ``T`` name
    the row, ``run_T``, ``run_heads`` ([H_qk, HV], HV a multiple of H_qk) and
    ``K`` (default 128) are the shape it ran, ``timing`` is "cuda_graph" or
    "eager" (default: eager), and ``fla_ms`` and ``gdn_kcp_ms`` are
    ``{"forward": ms, "backward": ms}``, or absent (``<name>_error`` says
    why). Anything else is a ValueError naming it."""
    results = calibration_results(check)
    rows = results.get("calibration") if isinstance(results, Mapping) else None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"the GPU check's 'calibration' = {rows!r}: expected a non-empty list of rows")
    out = []
    for i, row in enumerate(rows):
        where = f"calibration[{i}]"
        if not isinstance(row, Mapping):
            raise ValueError(f"{where} = {row!r}: expected an object")
        label = ", ".join(f"{key} {_positive_int(row, key, where)}" for key in ("H_qk", "HV", "T"))
        heads = row.get("run_heads")
        if not (isinstance(heads, list) and len(heads) == 2 and all(type(h) is int and h >= 1 for h in heads)
                and heads[1] % heads[0] == 0):
            raise ValueError(f"{where}['run_heads'] = {heads!r}: expected [H_qk, HV], HV a multiple of H_qk")
        timing = row.get("timing", "eager")
        if timing not in TIMINGS:
            raise ValueError(f"{where}['timing'] = {timing!r}: expected one of {TIMINGS}")
        measured, errors = {}, {}
        for name in IMPLEMENTATIONS:
            if f"{name}_ms" in row:
                measured[name], reason = _measured_ms(row[f"{name}_ms"], f"{where}[{name + '_ms'!r}]")
            else:
                reason = str(row.get(f"{name}_error", "not measured")).splitlines()[0]
            if reason:
                errors[name] = reason
        out.append(CheckRow(label, heads[0], heads[1], _positive_int(row, "run_T", where),
                            _positive_int(row, "K", where, 128), timing, measured, errors))
    return out


def measured_rows(rows: Sequence[CheckRow], name: str) -> list[tuple[int, Measured]]:
    """Implementation ``name``'s usable times at the shapes run, each with the
    index of its row (two rows of a dry run can run the same shape)."""
    return [(i, Measured(row.H, row.HV, row.T, phase, ms, row.K))
            for i, row in enumerate(rows) for phase, ms in row.measured.get(name, {}).items()]


def constants(m: Machine) -> dict[str, float]:
    """The fitted constants of machine ``m``."""
    return {name: getattr(m, name) for name in FIT_RANGES}


def no_refit_reason(check: Mapping, rows: Sequence[CheckRow]) -> str:
    """Why a check has no FLA time to refit to, from its own error strings,
    each once: the failed import its calibration records (``fla_error``, or
    ``calibration_fla_error`` as older flat checks name it), then each row's."""
    results = calibration_results(check)
    why = [results[key].splitlines()[0] for key in ("fla_error", "calibration_fla_error")
           if isinstance(results.get(key), str)]
    why += [row.errors["fla"] for row in rows if "fla" in row.errors]
    return (f"no usable FLA rows in the check's calibration ({'; '.join(dict.fromkeys(why))}): "
            "cannot refit; ours are predicted with the committed constants")


def stage_status(check: Mapping) -> str | None:
    """The calibration stage's status in the nested layout ("ran", or e.g.
    "timed out" for a stage whose rows are those it finished before its
    cap); None in the flat layout, which does not record one."""
    stage = check.get("stages", {}).get("calibration") if isinstance(check.get("stages"), Mapping) else None
    return stage.get("status") if isinstance(stage, Mapping) else None


def recalibrate(check: Mapping, facts: Mapping, committed: Machine = H200) -> dict:
    """Refit the three constants to a GPU check's measured FLA rows (ours held
    out), then set every row and phase beside the refit model: FLA's rows
    show how well the fit reproduces its own data, ours how well the model
    predicts rows it never saw. ``misses``: every row off by more than
    :data:`MISS_LIMIT`. With no usable FLA time nothing is refit, ``error``
    says why and ours are set against the ``committed`` constants."""
    rows = check_rows(check)
    fla, ours = measured_rows(rows, "fla"), measured_rows(rows, "gdn_kcp")
    refit = fit(facts["fla"], committed, [m for _, m in fla]) if fla else None
    machine = refit or committed
    tables = {"fla": zip(fla, calibration_table(facts["fla"], machine, [m for _, m in fla])),
              "gdn_kcp": zip(ours, prediction_table(facts["ours"], machine, [m for _, m in ours]))}
    lines = [{"row": row.label, "run_T": row.T, "run_heads": [row.H, row.HV], "K": row.K, "timing": row.timing,
              "phase": phase, **dict.fromkeys(IMPLEMENTATIONS)} for row in rows for phase in PHASES]
    for name, pairs in tables.items():
        for (i, m), entry in pairs:
            lines[len(PHASES) * i + PHASES.index(m.phase)][name] = {k: entry[k] for k in ("ms", "model_ms", "error")}
    misses = [{"implementation": name, "row": line["row"], "phase": line["phase"], "error": line[name]["error"]}
              for line in lines for name in IMPLEMENTATIONS if line[name] and abs(line[name]["error"]) > MISS_LIMIT]
    return {"stage": stage_status(check), "timing": {kind: sum(row.timing == kind for row in rows) for kind in TIMINGS},
            "committed": constants(committed), "refit": constants(refit) if refit else None,
            "miss_limit": MISS_LIMIT, "rows": lines, "misses": misses,
            "left_out": {f"{IMPLEMENTATIONS[name]} at {row.label}": reason
                             for row in rows for name, reason in row.errors.items()},
            "kda_elementwise": kda_elementwise(check, facts, machine),
            "error": None if refit else no_refit_reason(check, rows)}


def recalibration_markdown(report: dict) -> str:
    """The recalibration's report: the timing caveat, the constants, every
    row and phase against the model, the misses named."""
    eager, rows = report["timing"]["eager"], sum(report["timing"].values())
    timing = (f"Timings: eager in {eager} of {rows} rows. The model assumes CUDA-graph replays: eager times add "
              "launch overheads, so read every error with care." if eager
              else "Timings: CUDA-graph replays, as the model assumes.")
    lines = [timing, "", "| constant | committed (H200) | refit |", "|---|---:|---:|"]
    if report.get("stage") not in (None, "ran"):
        lines[:0] = [f"The calibration stage {report['stage']}: these are the rows it finished.", ""]
    for name, value in report["committed"].items():
        refit = f"{report['refit'][name]:.4g}" if report["refit"] else "-"
        lines.append(f"| {name} | {value:.4g} | {refit} |")
    model = "refit" if report["refit"] else "committed"
    lines += ["", f"| row | run T, H_qk, HV, K | timing | phase | FLA measured (ms) | FLA {model} model (ms) | error | "
              f"ours measured (ms) | ours {model} model (ms) | error |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]

    def cells(entry: dict | None) -> str:
        if entry is None:
            return " - | - | - "
        return f" {entry['ms']:.3f} | {entry['model_ms']:.3f} | {entry['error']:+.0%} "

    for r in report["rows"]:
        run = ", ".join(map(str, (r["run_T"], *r["run_heads"], r["K"])))
        lines.append(f"| {r['row']} | {run} | {r['timing']} | {r['phase']} |{cells(r['fla'])}|{cells(r['gdn_kcp'])}|")
    misses = "; ".join(f"{IMPLEMENTATIONS[x['implementation']]} {x['row']} {x['phase']} ({x['error']:+.0%})"
                       for x in report["misses"])
    lines += ["", f"MISS >{report['miss_limit']:.0%}: {misses or 'none'}"]
    lines += [f"Left out: {where}: {reason}" for where, reason in report["left_out"].items()]
    lines += ["", kda_elementwise_markdown(report["kda_elementwise"])]
    return "\n".join(lines)


# ---------------------------------------------------------------- KDA's elementwise rate

ELEMENTWISE_SHARE = 0.5
"""A profiled KDA kernel enters the fit of the elementwise rate when its
elementwise work is at least this share of its modelled time at the assumed
rate: there the rate decides the time, and bytes and tensor-core work, which
the GDN rows calibrate, do not."""

EFFICIENCY_RANGE = (1e-3, 4.0)
"""The elementwise efficiencies (fractions of the fp32 issue peak) the fit
searches. Above 1 is beyond the issue peak: a fit there says the counts
overstate the work, and it is reported as such rather than clipped at 1."""

RATIO_TOLERANCE = 0.10
"""A KDA ratio (ours over the faster FLA path) that moves by more than this
under the fitted rate has moved: the calibration rows themselves sit within
-9 % and +8 % of the model, so a smaller change is inside the model's own
error."""

SIDE_GROUPS = {"ours": ("ours",), "FLA": ("fla", "fla_safe_gate")}
"""The per-side fits beside the joint one: if ours and FLA's kernels run
their elementwise work at different rates, one rate for both (the model's
unit) misprices one side."""


class NoKdaProfile(ValueError):
    """The check holds no KDA kernel times: its profile stage did not run, or
    ran before it had KDA rows (an older check)."""


@dataclass(frozen=True)
class KdaProfile:
    """The profile stage's KDA rows: the shape they ran (one document, the
    model's shape), our segments there, each path's milliseconds by profiler
    event (:data:`roofline.KDA_SIDES`: ours, FLA's two intra paths), why a
    path is missing, and the stage's status."""

    shape: Shape
    P: int
    measured: Mapping[str, Mapping[str, float]]
    errors: Mapping[str, str]
    status: str | None


def kda_profile(check: object) -> KdaProfile:
    """The KDA rows of a GPU check's profile stage (``kda_shape``,
    ``kda_kernel_ms`` and the paths' errors), read whatever the stage's
    status (each path is written when it is measured); a
    :class:`NoKdaProfile` naming why there are none, a ValueError naming
    what is malformed."""
    stages = check.get("stages") if isinstance(check, Mapping) else None
    stage = stages.get("profile") if isinstance(stages, Mapping) else None
    if not isinstance(stage, Mapping):
        raise NoKdaProfile("the GPU check did not run its profile stage")
    results = stage.get("results")
    if not isinstance(results, Mapping) or "kda_kernel_ms" not in results:
        error = headline(stage["error"]) if isinstance(stage.get("error"), str) else ""
        raise NoKdaProfile(f"the GPU check's profile stage has no KDA rows (status {stage.get('status')!r}"
                           + (f": {error})" if error else ")"))
    where = "profile['kda_shape']"
    shape = results.get("kda_shape")
    if not isinstance(shape, Mapping):
        raise ValueError(f"{where} = {shape!r}: expected an object")
    T, docs, H, HV, K, V, P = (_positive_int(shape, key, where)
                               for key in ("T", "documents", "H_qk", "HV", "K", "V", "P"))
    if HV % H:
        raise ValueError(f"{where}: HV = {HV} is not a multiple of H_qk = {H}")
    table = results["kda_kernel_ms"]
    if not isinstance(table, Mapping) or not set(table) <= set(KDA_SIDES):
        raise ValueError(f"profile['kda_kernel_ms'] = {table!r}: expected {{path: {{kernel: ms}}}}, "
                         f"paths of {KDA_SIDES}")
    measured = {}
    for side, rows in table.items():
        if not isinstance(rows, Mapping):
            raise ValueError(f"profile['kda_kernel_ms'][{side!r}] = {rows!r}: expected {{kernel: ms}}")
        measured[side] = {kernel: float(ms) for kernel, ms in rows.items()
                          if not isinstance(ms, bool) and isinstance(ms, (int, float)) and math.isfinite(ms) and ms > 0}
    errors = {side: (str(results.get(f"kda_{side}_error") or results.get("kda_fla_error") or "not measured")
                     .splitlines() or [""])[0] for side in KDA_SIDES if side not in measured}
    return KdaProfile(model_shape(T, docs, H, HV, K, V), P, measured, errors, stage.get("status"))


def kda_kernel_model_ms(profile: KdaProfile, facts: Mapping, m: Machine, sides: Sequence[str] = KDA_SIDES
                        ) -> dict[str, dict[str, float]]:
    """The model's milliseconds of every KDA kernel at the profiled shape on
    machine ``m``, by side and by the profiler's name of the kernel (a
    kernel launched twice a step, or under two labels, sums its launches;
    FLA's torch ops between kernels are left out: bytes only, no elementwise
    work to learn from)."""
    estimates = {"ours": lambda: estimate(our_kda_shape_launches(profile.shape, P=profile.P), facts["ours"], m),
                 "fla": lambda: fla_kda_estimate(profile.shape, kda_facts(facts), m),
                 "fla_safe_gate": lambda: fla_kda_estimate(profile.shape, kda_facts(facts, True), m, True)}
    out = {}
    for side in sides:
        rows: dict[str, float] = {}
        for r in estimates[side]()["rows"]:
            if r["products"] != "torch":
                name = kernel_of(r["kernel"])
                rows[name] = rows.get(name, 0.0) + r["n"] * r["time"] * 1e3
        out[side] = rows
    return out


def fit_efficiency(points: Sequence[tuple[str, str, float]], model_at: Callable[[float], Mapping],
                   bounds: tuple[float, float] = EFFICIENCY_RANGE) -> float:
    """The elementwise efficiency whose model best reproduces ``points``
    ((side, kernel, measured ms)): least squares of the log ratio model /
    measured, as the three constants' fit. The model is piecewise in the
    rate (a launch takes the larger of its compute, memory and serial
    times), so the search is a log-spaced grid, then a golden section about
    its best point."""
    def loss(log_e: float) -> float:
        model = model_at(math.exp(log_e))
        return sum(math.log(model[side][kernel] / ms) ** 2 for side, kernel, ms in points)

    lo, hi = (math.log(b) for b in bounds)
    grid = [lo + (hi - lo) * i / 48 for i in range(49)]
    best = min(range(len(grid)), key=lambda i: loss(grid[i]))
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    while b - a > 1e-5:
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        a, b = (a, d) if loss(c) <= loss(d) else (c, b)
    return math.exp((a + b) / 2)


def kda_elementwise(check: Mapping, facts: Mapping, m: Machine) -> dict:
    """Fit or check the rate of KDA's elementwise work from the profile
    stage's per-kernel times (:func:`kda_profile`), the model's other
    constants those of ``m``: every profiled kernel the model counts beside
    its model at the assumed rate (``m.compute_efficiency`` of the fp32
    peak); the rate fitted to the kernels whose modelled time the
    elementwise work dominates (:data:`ELEMENTWISE_SHARE`), for both sides
    at once and for each alone; each kernel at the fitted rate; and KDA's
    ratios (ours over the faster FLA path, ``roofline.kda_rows``' three
    shapes) under both rates. ``error`` says why there is no fit (no KDA
    rows, or none of the model's kernels among them)."""
    try:
        profile = kda_profile(check)
    except NoKdaProfile as error:
        return {"error": str(error)}
    assumed = m.compute_efficiency
    cache: dict[float, dict] = {}

    def model_at(efficiency: float) -> dict:
        if efficiency not in cache:
            cache[efficiency] = kda_kernel_model_ms(profile, facts, with_elementwise(m, efficiency),
                                                    list(profile.measured))
        return cache[efficiency]

    at_assumed, free = model_at(assumed), model_at(math.inf)
    kernels = []
    for side, rows in at_assumed.items():
        for kernel, ms in rows.items():
            if kernel in profile.measured[side] and ms > 0:
                measured, share = profile.measured[side][kernel], 1 - free[side][kernel] / ms
                kernels.append({"side": side, "kernel": kernel, "measured_ms": measured, "model_ms": ms,
                                "error": ms / measured - 1, "elementwise_share": share,
                                "fitted": share >= ELEMENTWISE_SHARE})
    left_out = {f"{side} kernels": "not profiled: " + ", ".join(missing) for side, rows in at_assumed.items()
                if (missing := [kernel for kernel in rows if kernel not in profile.measured[side]])}
    left_out |= profile.errors
    report = {"stage": profile.status, "shape": {"T": profile.shape.T, "documents": profile.shape.fragments,
                                                 "H_qk": profile.shape.H, "HV": profile.shape.HV, "K": profile.shape.K,
                                                 "V": profile.shape.V, "P": profile.P},
              "assumed_efficiency": assumed, "share_limit": ELEMENTWISE_SHARE, "left_out": left_out}
    chosen = [k for k in kernels if k["fitted"]]
    if not chosen:
        why = "none of the model's KDA kernels was profiled" if not kernels else \
            f"no profiled KDA kernel is at least {ELEMENTWISE_SHARE:.0%} elementwise work in the model"
        return report | {"kernels": kernels, "error": why}
    fits = {"both": fit_efficiency([(k["side"], k["kernel"], k["measured_ms"]) for k in chosen], model_at)}
    for group, sides in SIDE_GROUPS.items():
        points = [(k["side"], k["kernel"], k["measured_ms"]) for k in chosen if k["side"] in sides]
        fits[group] = fit_efficiency(points, model_at) if points else None
    fitted = model_at(fits["both"])
    for k in kernels:
        k["fitted_model_ms"] = fitted[k["side"]][k["kernel"]]
        k["fitted_error"] = k["fitted_model_ms"] / k["measured_ms"] - 1
    before, after = kda_rows(facts, m), kda_rows(facts, with_elementwise(m, fits["both"]))
    ratios = [{"H_qk": b["H"], "HV": b["HV"], "P": b["P"], "assumed": faster_ratio(b), "fitted": faster_ratio(a)}
              for b, a in zip(before, after)]
    return report | {"fitted_efficiency": fits, "kernels": kernels, "ratios": ratios,
                     "ratio_tolerance": RATIO_TOLERANCE,
                     "ratios_move": any(abs(r["fitted"] / r["assumed"] - 1) > RATIO_TOLERANCE for r in ratios),
                     "misses": [f"{k['side']} {k['kernel']}" for k in kernels if abs(k["fitted_error"]) > MISS_LIMIT],
                     "error": None}


def faster_ratio(row: Mapping) -> float:
    """Ours over the faster FLA path in a row of ``roofline.kda_rows``."""
    return row["ours_ms"] / min(row["fla_ms"], row["fla_safe_gate_ms"])


def kda_elementwise_markdown(report: Mapping) -> str:
    """The elementwise rate's section of the recalibration's report."""
    if report.get("error") and "kernels" not in report:
        return f"KDA's elementwise rate: not measured ({report['error']})."
    s = report["shape"]
    slots = H200.fp32 / 2 / 1e12  # T slots/s at the fp32 issue peak (an issue slot is 2 FLOPs)
    lines = [f"KDA's elementwise rate, from the profile stage at T = {s['T']} ({s['documents']} document), "
             f"H_qk = {s['H_qk']}, HV = {s['HV']}, K = {s['K']}, V = {s['V']}, ours at P = {s['P']}"
             + (f" (the stage {report['stage']}: the paths it finished)"
                if report.get("stage") not in (None, "ran") else "")
             + f". Assumed: {report['assumed_efficiency']:.3g} of the fp32 issue peak "
             f"({report['assumed_efficiency'] * slots:.2f} T slots/s)."]
    if report.get("error"):
        lines.append(f"No fit: {report['error']}.")
    else:
        fits = report["fitted_efficiency"]
        bounded = [group for group, e in fits.items()
                   if e is not None and min(abs(math.log(e / bound)) for bound in EFFICIENCY_RANGE) < 1e-3]
        lines.append("Fitted (kernels at least {:.0%} elementwise work): ".format(report["share_limit"]) + ", ".join(
            f"{group} {e:.3g} ({e * slots:.2f} T slots/s)" if e is not None else f"{group} -"
            for group, e in fits.items()) + (" (beyond the issue peak: the counts overstate the work)"
                                             if fits["both"] > 1 else "")
            + (f" ({', '.join(bounded)} at the search's bound {EFFICIENCY_RANGE}: no minimum inside it)"
               if bounded else "") + ".")
    if report["kernels"]:
        lines += ["", "| side | kernel | elementwise share | fitted | measured (ms) | model, assumed (ms) | error | "
                  "model, fitted (ms) | error |", "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for k in report["kernels"]:
        fitted = f"{k['fitted_model_ms']:.3f} | {k['fitted_error']:+.0%}" if "fitted_model_ms" in k else "- | -"
        lines.append(f"| {k['side']} | {k['kernel']} | {k['elementwise_share']:.0%} | "
                     f"{'yes' if k['fitted'] else 'no'} | {k['measured_ms']:.3f} | {k['model_ms']:.3f} | "
                     f"{k['error']:+.0%} | {fitted} |")
    if not report.get("error"):
        lines += ["", "| H_qk | HV | P | ours / faster FLA, assumed rate | fitted rate |", "|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['H_qk']} | {r['HV']} | {r['P']} | {r['assumed']:.2f} | {r['fitted']:.2f} |"
                  for r in report["ratios"]]
        verdict = "move" if report["ratios_move"] else "hold"
        lines += ["", f"KDA's ratios {verdict} (by more than {report['ratio_tolerance']:.0%} at some shape: "
                  f"{'yes' if report['ratios_move'] else 'no'}). MISS >{MISS_LIMIT:.0%} at the fitted rate: "
                  f"{'; '.join(report['misses']) or 'none'}"]
    lines += [f"Left out: {where}: {reason}" for where, reason in report["left_out"].items()]
    return "\n".join(lines)


def run_recalibration(path: Path, facts: Mapping, as_json: bool) -> None:
    """``--recalibrate``: print the report of :func:`recalibrate` on the GPU
    check's JSON at ``path``; exit non-zero when the check has no calibration
    rows (after the KDA elementwise rate's report where its profile stage
    has KDA rows) or when it could not refit (a report with misses still
    exits 0: the misses are its findings, and so is a KDA rate that moves
    the ratios)."""
    try:
        check = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from error
    try:
        report = recalibrate(check, facts)
    except NoCalibration as error:
        # the KDA rows stand alone (a check run with --stages profile, say): their report before the exit
        kda = kda_elementwise(check, facts, H200)
        if "kernels" in kda:
            print(json.dumps({"source": str(path), "kda_elementwise": kda}, indent=1) if as_json
                  else f"### Recalibration from {path}\n\n{kda_elementwise_markdown(kda)}")
        sys.exit(f"roofline --recalibrate: {path}: {error}")
    if as_json:
        print(json.dumps({"source": str(path), **report}, indent=1))
    else:
        print(f"### Recalibration from {path}\n\n{recalibration_markdown(report)}")
    if report["error"]:
        sys.exit(f"roofline --recalibrate: {report['error']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", type=Path, metavar="GPU_CHECK_JSON", help="a GPU check's gpu_check.json")
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    args = parser.parse_args()
    facts = load_facts()
    warn_if_stale(facts)
    run_recalibration(args.check, facts, args.json)


if __name__ == "__main__":
    main()
