"""Operator-level mutation testing of the numerical code: programs, host path,
exchanges and layers. Each mutant is one small bug, generated from the code
as it stands; the tests mapped to its file must fail on it.

    python tools/mutate_numeric.py [--sample 64] [--seed 0] [--list] [--only TEXT] [--timeout 600]

Operators (on the AST of every function body; docstrings and module-level
constants are left alone):
  compare   ``<`` <-> ``<=``, ``>`` <-> ``>=``, ``==`` <-> ``!=``
  off-by-one  an int literal ``n`` in arithmetic, a comparison, a slice or a
            call's arguments becomes ``n + 1``
  sign      ``+`` <-> ``-``; a unary minus dropped
  factor    ``a * b`` -> ``a``, ``a / b`` -> ``a`` (a dropped factor)
  flag      ``True`` <-> ``False`` as a keyword argument; ``not x`` -> ``x``
  operand   ``a - b`` -> ``b - a``; the first two arguments of a product
            (``tl.dot``, ``mm``, ``torch.matmul``, ``torch.einsum`` operands) swapped
  narrow    a reduction's summands (``x.sum(...)``, ``tl.sum(x, ...)``) rounded
            to the input dtype, where the function names the precision rule
            (``mode`` in a torch program, the ``MM`` constexpr in a Triton one)
  cancel    in ``a - y.sum(...)`` with a reduction on both sides, the right
            side's summands rounded to the input dtype (as ``narrow``): the two
            sides of a difference that should cancel, rounded differently, as
            a gate gradient summed from dq's and dk's products was (killed by
            the precision table, tests/test_precision_table.py)
Every candidate of every file is listed (``--list``); a fixed-seed sample of
``--sample`` mutants is drawn round-robin over the files (each file's
candidates shuffled by the seed), so every file gets its share. Each runs
the test files :data:`TEST_MAP` maps to its path (stopping at the first
failure) in a copy of the checkout, and the report counts killed, survived
and timed out. A survivor listed in :data:`EQUIVALENT` (with the reason it
computes the same numbers) is reported as equivalent; any other survivor
makes the exit status 1. Not CI: a sample of 64 takes about an hour on 2 cores.
"""

from __future__ import annotations

import argparse
import ast
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mutate_queries  # noqa: E402  (the checkout copy and the test runner are shared)

SOURCES = ("kernels", "gdn_kcp/host", "gdn_kcp/exchange", "gdn_kcp/layers")
SKIPPED = ("kernels/triton/compile_specs.py",)
"""Compile facts for the sm_90 check, not numerics."""

PRECISION_TESTS = ("tests/test_programs.py", "tests/test_chunk_vs_oracle.py", "tests/test_precision_table.py")
TRITON_PRECISION_TESTS = "tests/test_precision_table.py::test_triton_programs"

TEST_MAP = {
    "kernels/torch/short_conv.py": ("tests/test_short_conv.py", "tests/test_recurrent.py"),
    "kernels/torch/recurrent.py": ("tests/test_recurrent.py", "tests/test_layer_decode.py"),
    # the KCP programs run only on fragments that cross ranks, the segment programs only at P > 1
    "kernels/torch/summary_walk.py": ("tests/test_programs.py", "tests/test_kcp_multirank.py"),
    "kernels/torch/adjoint_summary.py": ("tests/test_programs.py", "tests/test_kcp_multirank.py"),
    "kernels/torch/segment_summary.py": ("tests/test_programs.py", "tests/test_segments.py"),
    "kernels/torch/compose_segments.py": ("tests/test_programs.py", "tests/test_segments.py"),
    "kernels/torch/adjoint_segment_summary.py": ("tests/test_programs.py", "tests/test_segments.py"),
    "kernels/torch/compose_adjoints.py": ("tests/test_programs.py", "tests/test_segments.py"),
    "kernels/torch/tape_walk.py": ("tests/test_programs.py", "tests/test_chunk_vs_oracle.py", "tests/test_segments.py"),
    "kernels/torch/adjoint_walk.py": ("tests/test_programs.py", "tests/test_chunk_vs_oracle.py",
                                      "tests/test_segments.py"),  # the walks' carry planes: segments only
    # the output program runs only in a forward that keeps its tapes (save_mode="full") or at K > 128
    "kernels/torch/output.py": ("tests/test_programs.py", "tests/test_chunk_vs_oracle.py", "tests/test_save_modes.py"),
    # the gate gradient's sums and the adjoint's pull: low precision is where they go wrong
    "kernels/torch/bwd_dqkwg.py": PRECISION_TESTS,
    "kernels/torch/bwd_wy.py": PRECISION_TESTS,
    "kernels/torch/_walk.py": PRECISION_TESTS,
    "kernels/torch/": ("tests/test_programs.py", "tests/test_chunk_vs_oracle.py", "tests/test_wy_inverse.py"),
    "kernels/triton/short_conv.py": ("tests/test_short_conv.py", "tests/test_recurrent.py"),
    "kernels/triton/recurrent.py": ("tests/test_recurrent.py",),
    "kernels/triton/prep.py": ("tests/test_wy_inverse.py", "tests/test_triton_programs.py"),
    "kernels/triton/wy_inverse.py": ("tests/test_wy_inverse.py", "tests/test_triton_programs.py"),
    "kernels/triton/_common.py": ("tests/test_triton_programs.py", "tests/test_gate_keywords.py"),  # the gate loads
    "kernels/triton/traced_launches.py": ("tests/test_traced_triton.py",),  # the launches on fake CUDA tensors
    "kernels/triton/bwd_dqkwg.py": ("tests/test_triton_programs.py", TRITON_PRECISION_TESTS),
    "kernels/triton/bwd_wy.py": ("tests/test_triton_programs.py", TRITON_PRECISION_TESTS),
    "kernels/triton/adjoint_walk.py": ("tests/test_triton_programs.py", TRITON_PRECISION_TESTS),
    "kernels/triton/": ("tests/test_triton_programs.py",),
    "kernels/segments.py": ("tests/test_segments.py",),
    "kernels/precision.py": ("tests/test_precision.py", "tests/test_programs.py"),
    "kernels/": ("tests/test_programs.py", "tests/test_chunk_vs_oracle.py"),
    "gdn_kcp/host/segments.py": ("tests/test_segments.py",),
    # the traced host path (trace_host_path: adopted exchange results, ordered ops) runs in the lowering tests
    "gdn_kcp/host/": ("tests/test_chunk_vs_oracle.py", "tests/test_gate_keywords.py", "tests/test_kcp_multirank.py",
                      "tests/test_inductor_lowering.py"),
    # the ordered exchange ops' bodies run only under trace_host_path (eager hops call the helpers directly)
    "gdn_kcp/exchange/ordered.py": ("tests/test_kcp_multirank.py", "tests/test_inductor_lowering.py"),
    "gdn_kcp/exchange/": ("tests/test_kcp_multirank.py",),
    "gdn_kcp/layers/short_conv.py": ("tests/test_short_conv.py", "tests/test_layer.py"),
    "gdn_kcp/layers/cache.py": ("tests/test_layer_decode.py",),
    "gdn_kcp/layers/gated_deltanet.py": ("tests/test_layer.py", "tests/test_layer_decode.py",
                                         "tests/test_layer_kcp.py"),
    "gdn_kcp/layers/delta_layer.py": ("tests/test_layer.py", "tests/test_layer_decode.py",
                                      "tests/test_layer_kcp.py", "tests/test_kda_layer.py"),
    "gdn_kcp/layers/kimi_delta_attention.py": ("tests/test_kda_layer.py",),
    "gdn_kcp/layers/": ("tests/test_layer.py", "tests/test_layer_kcp.py"),
}
"""The test files a maintainer runs for a change to each path (the first
matching prefix wins; on this 2-core machine: programs 10 s, the oracle
tests 29 s, the Triton twins 100 s, KCP on 1-5 ranks 65 s, the layer 11 s
and 28 s on 1-4 ranks); the mutant runs them with ``-x``."""

EQUIVALENT: dict[str, str] = {
    "kernels/triton/recurrent.py:123 off-by-one: 1 -> 2":
        "the decode step's doc_bounds gain an entry past the N + 1 its N programs read",
    "kernels/segments.py:180 off-by-one: 4 -> 5":
        "row 4 of a fragment table is frag_doc, metadata that no program or host code reads",
    "kernels/torch/recurrent.py:48 off-by-one: 1 -> 2":
        "a finished document reads any valid row (its state and output are masked): max(T - 2, 0) is one",
    "kernels/torch/bwd_dqkwg.py:65 sign: -2 -> 2":
        "(dh * h).sum((2, -1)) over [chunks, HV, K, V]: dim 2 is dim -2",
    "kernels/torch/_chunks.py:149 sign: -2 -> 2":
        "cumsum(2) over the [chunks, HV, C, 1] masks every caller passes: dim 2 is dim -2",
    "kernels/torch/adjoint_summary.py:50 sign: index.n_chunks - 1 -> other sign":
        "the clamp of j < max_frag_chunks <= n_chunks at n_chunks +/- 1 never binds",
    "kernels/torch/summary_walk.py:65 off-by-one: 0 -> 1":
        "a last fragment that does not cross out then walks one chunk into S_loc; the exchange composes that "
        "S_loc only into the start state of a next fragment that does not cross in, which no walk reads",
}
"""Survivors that compute the same numbers, by mutant description, with why."""

PRODUCTS = {"dot", "mm", "matmul", "einsum", "bmm"}
REDUCTIONS = {"sum"}
_FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}


@dataclass
class NumericMutant:
    path: Path  # relative to the checkout
    node_index: int  # position of the node in ast.walk order
    kind: str
    line: int
    detail: str

    @property
    def what(self) -> str:
        return f"{self.path}:{self.line} {self.kind}: {self.detail}"

    def source(self, root: Path) -> str:
        tree = ast.parse((root / self.path).read_text())
        node = list(ast.walk(tree))[self.node_index]
        _apply(tree, node, self.kind)
        return ast.unparse(ast.fix_missing_locations(tree))


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _apply(tree: ast.AST, node: ast.AST, kind: str) -> None:
    """Edit ``tree`` in place: ``kind`` at ``node``."""
    if kind == "compare":
        node.ops = [_FLIP[type(node.ops[0])]()]
    elif kind == "off-by-one":
        node.value = node.value + 1
    elif kind == "sign" and isinstance(node, ast.BinOp):
        node.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
    elif kind == "sign":
        mutate_queries._replace(tree, node, node.operand)
    elif kind == "factor":
        mutate_queries._replace(tree, node, node.left)
    elif kind == "flag" and isinstance(node, ast.keyword):
        node.value = ast.Constant(not node.value.value)
    elif kind == "flag":
        mutate_queries._replace(tree, node, node.operand)
    elif kind == "operand" and isinstance(node, ast.BinOp):
        node.left, node.right = node.right, node.left
    elif kind == "operand":
        first = 1 if _callee(node) == "einsum" else 0
        args = node.args
        args[first], args[first + 1] = args[first + 1], args[first]
    elif kind in ("narrow", "cancel"):
        call = node.right if kind == "cancel" else node
        _round_summands(tree, call)
    else:
        raise ValueError(kind)


def _summands(call: ast.Call) -> ast.expr:
    """The tensor a reduction sums: ``x`` of ``x.sum(...)`` or ``tl.sum(x, ...)``."""
    return call.args[0] if isinstance(call.func, ast.Attribute) and _is_tl(call.func.value) else call.func.value


def _is_tl(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "tl"


def _round_summands(tree: ast.AST, call: ast.Call) -> None:
    """Round the summands of ``call`` to the input dtype under the function's
    precision rule: ``round_operands(mode, x)[0]`` (torch programs; imported
    into the module) or ``operand(x, MM).to(tl.float32)`` (Triton programs)."""
    x = ast.unparse(_summands(call))
    if _is_tl(call.func.value):
        call.args[0] = ast.parse(f"operand({x}, MM).to(tl.float32)", mode="eval").body
        module, name, level = "_common", "operand", 1
    else:
        call.func.value = ast.parse(f"round_operands(mode, {x})[0]", mode="eval").body
        module, name, level = "precision", "round_operands", 2
    after_imports = max(i for i, st in enumerate(tree.body) if isinstance(st, (ast.Import, ast.ImportFrom))) + 1
    tree.body.insert(after_imports, ast.ImportFrom(module=module, names=[ast.alias(name=name)], level=level))


def _in_function(tree: ast.AST) -> set[ast.AST]:
    """Nodes inside function bodies, docstrings left out."""
    inside = set()
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = func.body[1:] if ast.get_docstring(func) is not None else func.body
            for statement in body:
                inside.update(ast.walk(statement))
    return inside


def _is_reduction(node: ast.AST) -> bool:
    """``x.sum(...)`` or ``tl.sum(x, ...)`` (not ``torch.sum``)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in REDUCTIONS):
        return False
    owner = node.func.value
    return bool(node.args) if _is_tl(owner) else not (isinstance(owner, ast.Name) and owner.id == "torch")


def _under_precision_rule(tree: ast.AST) -> set[ast.AST]:
    """Reductions inside functions that name the precision rule: a ``mode``
    variable (torch programs) or an ``MM`` parameter (Triton programs)."""
    out = set()
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef):
            continue
        names = {a.arg for a in func.args.args + func.args.kwonlyargs}
        names |= {t.id for n in ast.walk(func) if isinstance(n, ast.Assign) for t in n.targets
                  if isinstance(t, ast.Name)}
        triton = any(isinstance(d, ast.Attribute) and d.attr == "jit" for d in func.decorator_list)
        if (triton and "MM" in names) or (not triton and "mode" in names):
            out.update(n for n in ast.walk(func) if _is_reduction(n))
    return out


def _int_literal_sites(tree: ast.AST) -> set[ast.AST]:
    """Int literals used in arithmetic, comparisons, slices or call arguments."""
    sites = set()
    for node in ast.walk(tree):
        children = []
        if isinstance(node, ast.BinOp):
            children = [node.left, node.right]
        elif isinstance(node, ast.Compare):
            children = [node.left, *node.comparators]
        elif isinstance(node, ast.Slice):
            children = [node.lower, node.upper, node.step]
        elif isinstance(node, ast.Call):
            children = list(node.args)
        elif isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Slice):
            children = [node.slice]
        sites.update(c for c in children if isinstance(c, ast.Constant) and type(c.value) is int)
    return sites


def _is_sequence(node: ast.AST) -> bool:
    """A tuple, list or shape expression: ``+`` there concatenates, it does no arithmetic."""
    if isinstance(node, (ast.Tuple, ast.List)):
        return True
    if isinstance(node, ast.BinOp):
        return _is_sequence(node.left) or _is_sequence(node.right)
    target = node.value if isinstance(node, ast.Subscript) else node
    return isinstance(target, ast.Attribute) and target.attr == "shape" and isinstance(node, ast.Subscript) and \
        isinstance(node.slice, ast.Slice)


def file_mutants(root: Path, path: Path) -> list[NumericMutant]:
    """Every candidate mutant of one file, in ast.walk order."""
    tree = ast.parse((root / path).read_text())
    inside, literals = _in_function(tree), _int_literal_sites(tree)
    roundable = _under_precision_rule(tree)
    out = []

    def add(index: int, node: ast.AST, kind: str, detail: str) -> None:
        out.append(NumericMutant(path, index, kind, getattr(node, "lineno", 0), detail))

    for index, node in enumerate(ast.walk(tree)):
        if node not in inside:
            continue
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _FLIP:
            add(index, node, "compare", f"{ast.unparse(node)} -> flipped {type(node.ops[0]).__name__}")
        elif isinstance(node, ast.Constant) and node in literals:
            add(index, node, "off-by-one", f"{node.value} -> {node.value + 1}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)) and not _is_sequence(node):
            add(index, node, "sign", f"{ast.unparse(node)} -> other sign")
            if isinstance(node.op, ast.Sub):
                add(index, node, "operand", f"{ast.unparse(node)} -> operands swapped")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)) and not _is_sequence(node):
            add(index, node, "factor", f"{ast.unparse(node)} -> {ast.unparse(node.left)}")
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            add(index, node, "sign", f"{ast.unparse(node)} -> {ast.unparse(node.operand)}")
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            add(index, node, "flag", f"{ast.unparse(node)} -> {ast.unparse(node.operand)}")
        elif isinstance(node, ast.keyword) and isinstance(node.value, ast.Constant) and type(node.value.value) is bool:
            add(index, node, "flag", f"{node.arg}={node.value.value} -> {not node.value.value}")
        elif isinstance(node, ast.Call) and _callee(node) in REDUCTIONS and node in roundable:
            add(index, node, "narrow", f"{ast.unparse(node)[:60]} -> summands rounded to the input dtype")
        elif isinstance(node, ast.Call) and _callee(node) in PRODUCTS:
            first = 1 if _callee(node) == "einsum" else 0
            if len(node.args) >= first + 2:
                add(index, node, "operand", f"{ast.unparse(node)[:60]} -> first two operands swapped")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and _is_reduction(node.right) \
                and node.right in roundable and any(_is_reduction(n) for n in ast.walk(node.left)):
            add(index, node, "cancel", f"{ast.unparse(node)[:60]} -> right side's summands rounded")
    return out


def source_files(root: Path) -> list[Path]:
    files = []
    for top in SOURCES:
        for file in sorted((root / top).rglob("*.py")):
            rel = file.relative_to(root)
            if str(rel) not in SKIPPED and file.name != "__init__.py":
                files.append(rel)
    return files


def sample(root: Path, n: int, seed: int) -> list[NumericMutant]:
    """``n`` mutants drawn round-robin over the files (each file's candidates
    in a seeded shuffle), so every file gets its share."""
    rng = random.Random(seed)
    pools = []
    for path in source_files(root):
        candidates = file_mutants(root, path)
        rng.shuffle(candidates)
        if candidates:
            pools.append(candidates)
    rng.shuffle(pools)
    picked = []
    while len(picked) < n and any(pools):
        for pool in pools:
            if pool and len(picked) < n:
                picked.append(pool.pop())
    return picked


def tests_for(path: Path) -> tuple[str, ...]:
    for prefix, tests in TEST_MAP.items():
        if str(path).startswith(prefix):
            return tests
    raise KeyError(f"no tests mapped to {path}")


def run(mutants: list[NumericMutant], root: Path, timeout: int) -> dict[str, list[str]]:
    verdicts: dict[str, list[str]] = {"killed": [], "survived": [], "timed out": [], "equivalent": [], "invalid": []}
    for number, mutant in enumerate(mutants, 1):
        # the copy imports kernels/ as gdn_kcp/kernels (mutate_queries.copy_checkout)
        installed = Path("gdn_kcp") / mutant.path if mutant.path.parts[0] == "kernels" else mutant.path
        target = root / installed
        original = target.read_text()
        start = time.perf_counter()
        try:
            mutated = mutant.source(root)
            compile(mutated, str(target), "exec")
        except (SyntaxError, ValueError) as err:
            verdicts["invalid"].append(f"{mutant.what} ({err})")
            continue
        try:
            target.write_text(mutated)
            passed, summary = mutate_queries.run_tests(timeout, tests_for(mutant.path))
        finally:
            target.write_text(original)
        if summary == "timed out":
            verdict = "timed out"
        elif passed:
            verdict = "equivalent" if mutant.what in EQUIVALENT else "survived"
        else:
            verdict = "killed"
        verdicts[verdict].append(mutant.what)
        print(f"[{number:3d}/{len(mutants)}] {verdict:10s} {mutant.what}  ({time.perf_counter() - start:.0f} s: "
              f"{summary})", flush=True)
    return verdicts


def report(verdicts: dict[str, list[str]]) -> int:
    ran = sum(len(verdicts[k]) for k in ("killed", "survived", "timed out", "equivalent"))
    live = ran - len(verdicts["equivalent"])
    killed = len(verdicts["killed"]) + len(verdicts["timed out"])  # a mutant that hangs the tests is caught
    print(f"\n{ran} mutants run: {len(verdicts['killed'])} killed, {len(verdicts['timed out'])} timed out, "
          f"{len(verdicts['survived'])} survived, {len(verdicts['equivalent'])} equivalent "
          f"({len(verdicts['invalid'])} invalid, not run)")
    if live:
        print(f"killed {killed} of {live} non-equivalent mutants: {100 * killed / live:.1f} %")
    for what in verdicts["equivalent"]:
        print(f"  equivalent: {what}: {EQUIVALENT[what]}")
    for what in verdicts["survived"]:
        print(f"  SURVIVED: {what}")
    return 1 if verdicts["survived"] else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=64, help="mutants to draw (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    parser.add_argument("--list", action="store_true", help="list the sample (with --all: every candidate) and stop")
    parser.add_argument("--all", action="store_true",
                        help="every candidate of every file instead of the sample (with --only: rerun named mutants)")
    parser.add_argument("--only", action="append",
                        help="run the mutants whose description holds this text (repeatable)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per mutant's tests (default 600)")
    args = parser.parse_args()
    root = mutate_queries.CHECKOUT
    if args.list:
        mutants = ([m for path in source_files(root) for m in file_mutants(root, path)] if args.all
                   else sample(root, args.sample, args.seed))
        print("\n".join(f"{m.what}  [{', '.join(tests_for(m.path))}]" for m in mutants))
        print(f"{len(mutants)} mutants over {len({m.path for m in mutants})} files")
        return 0
    with tempfile.TemporaryDirectory(prefix="gdn_kcp_numeric_mutants_") as tmp:
        copy = Path(tmp)
        mutate_queries.ROOT = copy
        mutate_queries.QUERIES = copy / "gdn_kcp" / "queries"
        mutate_queries.copy_checkout(copy)
        pool = ([m for path in source_files(copy) for m in file_mutants(copy, path)] if args.all
                else sample(copy, args.sample, args.seed))
        mutants = [m for m in pool if args.only is None or any(text in m.what for text in args.only)]
        return report(run(mutants, copy, args.timeout))


if __name__ == "__main__":
    sys.exit(main())
