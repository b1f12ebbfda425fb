"""Mutation check of the byte queries: change each term in turn and require a
test to fail.

    python tools/mutate_queries.py [--list] [--only SUBSTRING] [--timeout 300]

Terms: every pool and saved-tensor shape (doubled), every sum and product in
the size and payload formulas and in the layer's halo terms (one side
dropped; those run the layer's KCP tests), every bind and release of the
modelled schedule (dropped, one name at a time), the replayed-boundary count of
c1/c2, the arena alignment, the bytes of each pool and saved tensor (numel
times its dtype's size), and the dtype rule (each buffer dropped in turn from
``gdn_kcp.dtypes.INPUT_DTYPE_BUFFERS``), and the segment terms (the summary
row counts and table sizes of ``kernels/segments.py``). Each mutant is written over the source file,
the query and arena tests run against it (stopping at the first failure), and
the file is restored. The files must be committed first (a safety net: `git
checkout` restores them if the run is killed). Exit status 1 if any mutant
survives. Not part of CI: a full run takes tens of minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
ROOT = CHECKOUT  # the copy the mutants are written into, once main() has made it
QUERIES = ROOT / "gdn_kcp" / "queries"
TESTS = [
    "tests/test_readme_tables.py",
    "tests/test_workspace_layout.py",
    "tests/test_kcp_context.py",
    "tests/test_workspace_reuse.py",
    "tests/test_workspace_arena.py",
    "tests/test_kcp_multirank.py",
    "tests/test_segments.py",
]
LAYER_TESTS = ["tests/test_layer_kcp.py"]
SEGMENT_TESTS = ("tests/test_segments.py",)
"""What kills the mutants of the segment row counts and table sizes."""
"""What kills the mutants of the layer's halo terms (with_conv): the layer on 1 to 4 ranks."""


@dataclass
class Mutant:
    path: Path
    node_index: int  # position of the node in ast.walk order
    what: str
    apply: callable  # (tree, node) -> None, edits the tree in place
    tests: tuple[str, ...] = ()  # the test files to run (default: TESTS)

    def source(self) -> str:
        tree = ast.parse(self.path.read_text())
        node = list(ast.walk(tree))[self.node_index]
        self.apply(tree, node)
        return ast.unparse(ast.fix_missing_locations(tree))


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}


def _replace(tree: ast.AST, node: ast.AST, new: ast.AST) -> None:
    parent = _parents(tree)[node]
    for field, value in ast.iter_fields(parent):
        if value is node:
            setattr(parent, field, new)
            return
        if isinstance(value, list) and node in value:
            value[value.index(node)] = new
            return
    raise RuntimeError("node not found under its parent")


def _line(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}"


def shape_mutants(path: Path, function: str, target: str) -> list[Mutant]:
    """Every shape ``function`` assigns to ``target`` (the values of its
    ``target = {...}`` dict, both sides of a conditional value such as the
    gate's ``dgcum``, and its ``target[...] = (...)``): doubled."""
    out = []
    nodes = list(ast.walk(ast.parse(path.read_text())))
    shape_tuples = set()
    for node in nodes:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            for stmt in ast.walk(node):
                if isinstance(stmt, ast.Assign) and ast.unparse(stmt.targets[0]).startswith(target):
                    if isinstance(stmt.value, ast.Dict):
                        for value in stmt.value.values:
                            sides = (value.body, value.orelse) if isinstance(value, ast.IfExp) else (value,)
                            shape_tuples |= {id(side) for side in sides if isinstance(side, ast.Tuple)}
                    elif isinstance(stmt.value, ast.Tuple):
                        shape_tuples.add(id(stmt.value))
    for i, node in enumerate(nodes):
        if id(node) in shape_tuples:
            def apply(tree, n):
                n.elts.append(ast.Constant(2))
            out.append(Mutant(path, i, f"{_line(path, node)} shape {ast.unparse(node)} doubled", apply))
    return out


def binop_mutants(path: Path, functions: set[str], tests: tuple[str, ...] = ()) -> list[Mutant]:
    """Every ``a + b`` / ``a * b`` inside ``functions``: replaced by each side."""
    out = []
    nodes = list(ast.walk(ast.parse(path.read_text())))
    inside = set()
    for node in nodes:
        if isinstance(node, ast.FunctionDef) and node.name in functions:
            inside |= {id(n) for n in ast.walk(node)}
    for i, node in enumerate(nodes):
        if id(node) in inside and isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            for side in ("left", "right"):
                def apply(tree, n, side=side):
                    _replace(tree, n, getattr(n, side))
                out.append(Mutant(path, i, f"{_line(path, node)} {ast.unparse(node)} -> {ast.unparse(getattr(node, side))}",
                                  apply, tests))
    return out


def statement_mutants(path: Path, function: str, what: str) -> list[Mutant]:
    """Every ``saved[...] = ...`` (dropped) inside ``function``."""
    out = []
    nodes = list(ast.walk(ast.parse(path.read_text())))
    inside = set()
    for node in nodes:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            inside = {id(n) for n in ast.walk(node)}
    for i, node in enumerate(nodes):
        if id(node) in inside and isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
            if ast.unparse(node.targets[0].value) != what:
                continue
            def apply(tree, n):
                _replace(tree, n, ast.Pass())
            out.append(Mutant(path, i, f"{_line(path, node)} `{ast.unparse(node)}` dropped", apply))
    return out


def event_mutants(path: Path) -> list[Mutant]:
    """Every name of every ``ev.bind(...)`` / ``ev.release(...)``: dropped."""
    out = []
    nodes = list(ast.walk(ast.parse(path.read_text())))
    for i, node in enumerate(nodes):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("bind", "release") and ast.unparse(node.func.value) == "ev"):
            for j, arg in enumerate(node.args):
                def apply(tree, n, j=j):
                    del n.args[j]
                out.append(Mutant(path, i, f"{_line(path, node)} {node.func.attr} {ast.unparse(arg)} dropped", apply))
    return out


def constant_mutants(path: Path, names: set[str], new_value) -> list[Mutant]:
    """Module constants ``NAME = value`` set to ``new_value``, and ``2 if`` counts."""
    out = []
    nodes = list(ast.walk(ast.parse(path.read_text())))
    for i, node in enumerate(nodes):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id in names:
            def apply(tree, n):
                n.value = ast.Constant(new_value)
            out.append(Mutant(path, i, f"{_line(path, node)} {node.targets[0].id} = {new_value}", apply))
        if isinstance(node, ast.IfExp) and isinstance(node.body, ast.Constant) and node.body.value == 2:
            def apply(tree, n):
                n.body = ast.Constant(1)
            out.append(Mutant(path, i, f"{_line(path, node)} `{ast.unparse(node)}` counts once", apply))
    return out


def element_mutants(path: Path, name: str) -> list[Mutant]:
    """Every element of the module tuple ``name = (...)``: dropped."""
    out = []
    nodes = list(ast.walk(ast.parse(path.read_text())))
    for i, node in enumerate(nodes):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == name and isinstance(node.value, ast.Tuple):
            for j, element in enumerate(node.value.elts):
                def apply(tree, n, j=j):
                    del n.value.elts[j]
                out.append(Mutant(path, i, f"{_line(path, node)} {name} without {ast.unparse(element)}", apply))
    return out


def all_mutants() -> list[Mutant]:
    mutants = _all_mutants()
    for mutant in mutants:  # a segment pool's shape, term or event: the segment tests bind them
        line = int(mutant.what.split(" ", 1)[0].rsplit(":", 1)[1])
        if "seg_" in mutant.path.read_text().splitlines()[line - 1] and not mutant.tests:
            mutant.tests = SEGMENT_TESTS
    return mutants


def _all_mutants() -> list[Mutant]:
    shapes, schedule = QUERIES / "shapes.py", QUERIES / "schedule.py"
    comm, layout = QUERIES / "comm.py", QUERIES / "layout.py"
    return [
        *shape_mutants(shapes, "pool_shapes", "shapes"),
        *shape_mutants(shapes, "saved_shapes", "saved"),
        *statement_mutants(shapes, "saved_shapes", "saved"),
        *binop_mutants(shapes, {"pool_shapes", "saved_shapes"}),
        *event_mutants(schedule),
        *binop_mutants(comm, {"_payload", "ring_elements"}),
        *binop_mutants(comm, {"conv_channels", "halo_rounds", "halo_comm_bytes"}, tests=LAYER_TESTS),
        *binop_mutants(layout, {"gdn_saved_layout_kcp"}, tests=LAYER_TESTS),
        *constant_mutants(comm, set(), None),
        *constant_mutants(layout, {"ALIGN"}, 128),
        *binop_mutants(layout, {"tensor_nbytes"}),
        *shape_mutants(layout, "gdn_state_layout_kcp", "shapes"),
        *element_mutants(ROOT / "gdn_kcp" / "dtypes.py", "INPUT_DTYPE_BUFFERS"),
        *element_mutants(ROOT / "gdn_kcp" / "dtypes.py", "INDEX_BUFFERS"),
        *element_mutants(ROOT / "gdn_kcp" / "dtypes.py", "CHANNEL_COMPUTE_BUFFERS"),
        # the copy imports kernels/ as gdn_kcp/kernels (copy_checkout)
        *binop_mutants(ROOT / "gdn_kcp" / "kernels" / "segments.py",
                       {"capped_summary_rows", "table_elements", "summary_rows", "summary_row_counts"},
                       tests=SEGMENT_TESTS),
    ]


def run_tests(timeout: int, tests: tuple[str, ...] = ()) -> tuple[bool, str]:
    for cache in QUERIES.glob("__pycache__"):
        shutil.rmtree(cache)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *(tests or TESTS)]
    try:
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, "timed out"
    if result.returncode < 0:  # e.g. an out-of-bounds read of a mutated Triton program under the interpreter
        return False, f"crashed by signal {-result.returncode}"
    last = [line for line in result.stdout.splitlines() if line.strip()][-1:] or [f"exit status {result.returncode}"]
    return result.returncode == 0, last[0]


def copy_checkout(into: Path) -> None:
    """The tracked files of the checkout, as they are in the working tree, with
    ``kernels/`` also placed at ``gdn_kcp/kernels`` (its installed name). Run
    from the copy, ``import gdn_kcp`` finds the copy's package first, so edits
    to the checkout during a run do not reach it."""
    files = subprocess.run(["git", "ls-files"], cwd=CHECKOUT, capture_output=True, text=True, check=True)
    for name in files.stdout.splitlines():
        if (CHECKOUT / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(CHECKOUT / name, into / name)
    shutil.copytree(into / "kernels", into / "gdn_kcp" / "kernels")


def main() -> int:
    global ROOT, QUERIES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--only", help="run the mutants whose description holds this text")
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--start", type=int, default=1, help="resume a stopped run at mutant number START")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gdn_kcp_mutants_") as tmp:
        ROOT, QUERIES = Path(tmp), Path(tmp) / "gdn_kcp" / "queries"
        copy_checkout(ROOT)
        return run_mutants(args)


def run_mutants(args: argparse.Namespace) -> int:
    mutants = [m for m in all_mutants() if args.only is None or args.only in m.what]
    if args.list:
        print("\n".join(m.what for m in mutants))
        print(f"{len(mutants)} mutants")
        return 0
    survivors = []
    for number, mutant in enumerate(mutants, 1):
        if number < args.start:
            continue
        original = mutant.path.read_text()
        start = time.perf_counter()
        try:
            mutant.path.write_text(mutant.source())
            passed, summary = run_tests(args.timeout, mutant.tests)
        finally:
            mutant.path.write_text(original)
        verdict = "SURVIVED" if passed else "killed"
        print(f"[{number:3d}/{len(mutants)}] {verdict:8s} {mutant.what}  ({time.perf_counter() - start:.0f} s: {summary})",
              flush=True)
        if passed:
            survivors.append(mutant.what)
    for cache in QUERIES.glob("__pycache__"):
        shutil.rmtree(cache)
    ran = len(mutants) - args.start + 1
    print(f"\n{ran - len(survivors)} of {ran} mutants killed (numbers {args.start} to {len(mutants)})")
    for what in survivors:
        print(f"  survived: {what}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
