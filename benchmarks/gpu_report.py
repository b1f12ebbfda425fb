"""``gpu_check.md`` from ``gpu_check.json``: a line per stage (pass, FAIL or
ran; seconds against its cap), then every figure it wrote, flattened, so a
stage's new keys show without a change here."""

from __future__ import annotations


def verdict(stage: dict) -> str:
    if stage.get("status") != "ran":
        return stage.get("status", "not run").upper()
    results = stage.get("results", {})
    if "pass" not in results or results["pass"] is None:
        return "ran"
    return "pass" if results["pass"] else "FAIL"


def figure(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def flatten(value, prefix: str = "", depth: int = 0) -> list[str]:
    """``key: value`` lines, nested keys joined with ``/`` (three levels; deeper
    values printed whole)."""
    if isinstance(value, dict) and depth < 3:
        lines = []
        for key, inner in value.items():
            lines += flatten(inner, f"{prefix}/{key}" if prefix else str(key), depth + 1)
        return lines
    if isinstance(value, list) and value and all(isinstance(row, dict) for row in value) and depth < 3:
        lines = []
        for i, row in enumerate(value):
            lines += flatten(row, f"{prefix}[{i}]", depth + 1)
        return lines
    if isinstance(value, (list, tuple)):
        return [f"{prefix}: [{', '.join(figure(v) for v in value)}]"]
    return [f"{prefix}: {figure(value)}"]


def markdown(report: dict) -> str:
    head = report["run"]
    lines = [f"# GPU check, {head['date']}, {head['device']}", "",
             f"torch {head['torch']}, triton {head['triton']}, python {head['python']}; T = {head['T']} "
             f"({head['documents']} documents), (H_qk, HV, K, V) = {head['dims']}, {head['dtype']}; "
             f"{'quick' if head['quick'] else 'full'}{', dry run' if head['dry_run'] else ''}; "
             f"{head.get('seconds', '?')} s in all", "", "| stage | result | seconds | cap |", "|---|---|---:|---:|"]
    for name, stage in report["stages"].items():
        lines.append(f"| {name} | {verdict(stage)} | {stage.get('seconds', '')} | {stage.get('cap_s', '')} |")
    for name, stage in report["stages"].items():
        lines += ["", f"## {name}: {verdict(stage)}", ""]
        if stage.get("error"):
            lines += ["```", stage["error"].strip()[-2000:], "```"]
        lines += [f"- {line}" for line in flatten(stage.get("results", {}))]
    return "\n".join(lines) + "\n"
