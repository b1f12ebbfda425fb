"""Recalibrate the cost model of ``roofline.py`` from a GPU check's times.

Reads what ``benchmarks/gpu_check.py`` measured (its ``gpu_check.json``: the
calibration rows timed for ours and FLA at the shapes it ran), refits the
three constants to the FLA times alone and prints every row against the refit
model, ours held out as a prediction, naming each row the model misses by
more than 20 % and saying when the times were eager (the model assumes
CUDA-graph replays).

    python benchmarks/roofline.py --recalibrate DIR/gpu_check.json [--json]
    python benchmarks/recalibrate.py DIR/gpu_check.json [--json]

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import (  # noqa: E402  (benchmarks/roofline.py: the model)
    FIT_RANGES, H200, Machine, Measured, calibration_table, fit, load_facts, prediction_table, warn_if_stale)

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
    return "\n".join(lines)


def run_recalibration(path: Path, facts: Mapping, as_json: bool) -> None:
    """``--recalibrate``: print the report of :func:`recalibrate` on the GPU
    check's JSON at ``path``; exit non-zero when the check has no calibration
    rows or when it could not refit (a report with misses still exits 0: the
    misses are its findings)."""
    try:
        check = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from error
    try:
        report = recalibrate(check, facts)
    except NoCalibration as error:
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
