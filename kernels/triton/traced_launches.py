"""What ``torch.compile`` makes of the Triton programs' launches, without a GPU.

    python -m gdn_kcp.kernels.triton.traced_launches        # JSON: every launch of a traced step

Under :func:`gdn_kcp.trace_host_path`, Dynamo traces each ``kernel[grid](...)``
launch of the host path into a ``triton_kernel_wrapper_functional`` node, and
AOT autograd clones, before the launch, every tensor that torch's analysis of
the kernel's TTIR counts as written (``tensors_to_clone``). That analysis is
conservative: a tensor a store address depends on through a helper call counts
as written (see ``_common.chunk_tokens``). Counted wrongly, Inductor copies the
index tables and inputs before each launch, and a backward that "writes" its
inputs does not partition. This module checks it on the CPU:

- :func:`kernel_writes`: the analysis of every kernel of
  :mod:`.compile_specs` at its shipped configuration;
- :func:`traced_step`: a forward and backward of the FLA-style entry (bf16,
  in-kernel gate, beta and norm, initial and final states) and of
  ``gdn_kcp`` with two segments, compiled with fake tensors, the Triton
  programs standing in for the torch ones on CPU tensors and a stub sm_90
  target for the analysis (:func:`hopper_analysis`); returns every launch of
  both graphs with what it clones.

- :func:`inductor_plan`: the same FLA-style step compiled by Inductor (its
  output code is captured where it would be loaded, never run), the peak of
  the buffers its code allocates (:func:`planned_peak`) beside the byte
  queries.

``tests/test_traced_triton.py`` holds the first two to
:data:`.compile_specs.WRITES` and the third to the queries. Nothing runs a
kernel: what the launches compute is the interpreter tests' and the GPU
check's business.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import types
from collections.abc import Iterator

import torch
import triton

from .compile_specs import FLOATS, INDEX_TABLES, INTS, input_pointers, kernels


class _StubDriver:
    """Answers the one question torch's TTIR generation asks of Triton's driver."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def hopper_analysis() -> Iterator[None]:
    """Within the block, Dynamo treats Triton kernels as on a GPU machine and
    torch's mutation analysis generates TTIR for sm_90. On a machine with a
    GPU nothing changes."""
    import torch.utils._triton as torch_triton

    if torch.cuda.is_available():
        yield
        return
    has_triton, driver = torch_triton.has_triton, triton.runtime.driver
    previous = driver._active  # None without a GPU; reset_active() would look for a driver and fail
    torch_triton.has_triton = lambda: True  # read at trace time by Dynamo's variable builder
    driver.set_active(_StubDriver())
    try:
        yield
    finally:
        driver._active = previous
        torch_triton.has_triton = has_triton


def _argument(kernel_name: str, name: str):
    """A value for argument ``name``: what the compile specs type it as."""
    if name in FLOATS:
        return 0.5
    if name in INTS:
        return 16  # not 1: Triton specialises an int 1 to a constant
    if name in INDEX_TABLES:
        return torch.zeros(64, dtype=torch.int32)
    if name == "doc_bounds":
        return torch.zeros(64, dtype=torch.int64)
    return torch.zeros(64, dtype=torch.bfloat16 if name in input_pointers(kernel_name) else torch.float32)


def kernel_writes(K: int = 128, V: int = 128) -> dict[str, list[str]]:
    """Kernel (compile-spec name) -> the arguments torch's analysis counts as
    written; also ``"<kernel>[every store]"``, the plain spec with every
    ``HAS_*`` flag on (a store the specs leave off, such as compose_adjoints'
    ``out``, is analysed there)."""
    from torch._higher_order_ops.triton_kernel_wrap import get_mutated_tensors, kernel_side_table

    out = {}
    with hopper_analysis():
        for name, kernel, constexprs in kernels(K, V):
            unset = {p.name: True for p in kernel.params if p.is_constexpr and p.name not in constexprs}
            args = {p.name: _argument(name, p.name) for p in kernel.params if not p.is_constexpr}
            configs = {name: {**unset, **constexprs}}
            if "[" not in name:
                stores = {p.name: True for p in kernel.params if p.is_constexpr and p.name.startswith("HAS_")}
                configs[name + "[every store]"] = {**unset, **constexprs, **stores}
            for label, config in configs.items():
                out[label] = get_mutated_tensors(kernel_side_table.add_kernel(kernel),
                                                 kernel_side_table.add_constant_args(config), args, {})
    return out


def _launches(gm: torch.fx.GraphModule) -> list[dict]:
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    rows = []
    for node in gm.graph.nodes:
        if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            rows.append({"kernel": getattr(kernel, "fn", kernel).__name__,
                         "clones": sorted(node.kwargs["tensors_to_clone"])})
    return rows


def _written_inputs(gm: torch.fx.GraphModule) -> list[str]:
    """``kernel:argument`` of every launch that clones (writes) a tensor sharing
    storage with a graph input (an input, a saved tensor, a tangent, or a
    view of one), by the fake tensors' storages."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    def storage(node):
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        return StorageWeakRef(value.untyped_storage()) if isinstance(value, torch.Tensor) else None

    inputs = {storage(n) for n in gm.graph.nodes if n.op == "placeholder"} - {None}
    out = []
    for node in gm.graph.nodes:
        if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            for name in node.kwargs["tensors_to_clone"]:
                if storage(node.kwargs["kwargs"][name]) in inputs:
                    out.append(f"{getattr(kernel, 'fn', kernel).__name__}:{name}")
    return sorted(out)


def _graph_facts(kind: str, gm: torch.fx.GraphModule) -> dict:
    """Launches, gdn_kcp ops still called (but the boundaries), and inputs a launch writes."""
    return {
        "graph": kind,
        "launches": _launches(gm),
        "gdn_kcp_ops": program_ops(str(n.target) for n in gm.graph.nodes),
        "written_inputs": _written_inputs(gm),
    }


def traced_step(T: int = 70, H_qk: int = 1, HV: int = 2, K: int = 32, V: int = 32) -> list[dict]:
    """Compile a forward and backward of the FLA-style entry and of ``gdn_kcp``
    with two segments and ``save_mode="inverse"``, on fake bf16 tensors,
    Triton programs; the facts of every forward and backward graph
    (:func:`_graph_facts`)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gdn_kcp import OptionsKcp, build_kcp_context, chunk_gated_delta_rule, gdn_kcp, trace_host_path
    from gdn_kcp.host.programs import use_programs

    facts: list[dict] = []

    def keeper(kind: str):
        def compiler(gm, example_inputs):
            facts.append(_graph_facts(kind, gm))
            return make_boxed_func(gm)
        return compiler

    backend = aot_autograd(fw_compiler=keeper("forward"), bw_compiler=keeper("backward"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    A_log, dt_bias = torch.zeros(HV), torch.zeros(HV)

    def fla(q, k, v, a, b, h0, cu):
        o, final = chunk_gated_delta_rule(q, k, v, a, b, initial_state=h0, output_final_state=True, A_log=A_log,
                                          dt_bias=dt_bias, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                          use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        return o.float().sum() + final.sum()

    ctx = build_kcp_context([0, T], device=device)

    def segmented(q, k, v, a, b):
        o, _ = gdn_kcp(q, k, v, -a.float().abs().to(a.dtype), b.sigmoid(), ctx,
                       options=OptionsKcp(segments=2, use_qk_l2norm=True, save_mode="inverse"))
        return o.float().sum()

    torch._dynamo.reset()
    with hopper_analysis(), use_programs("cpu", "triton"), FakeTensorMode(allow_non_fake_inputs=True):
        A_log, dt_bias = A_log.to(device), dt_bias.to(device)
        leaf = dict(device=device, dtype=torch.bfloat16, requires_grad=True)
        q, k = torch.randn(1, T, H_qk, K, **leaf), torch.randn(1, T, H_qk, K, **leaf)
        v, a, b = torch.randn(1, T, HV, V, **leaf), torch.randn(1, T, HV, **leaf), torch.randn(1, T, HV, **leaf)
        h0 = torch.randn(2, HV, K, V, device=device, requires_grad=True)
        cu = torch.tensor([0, 30, T], device=device)
        with trace_host_path():
            torch.compile(fla, fullgraph=True, backend=backend)(q, k, v, a, b, h0, cu).backward()
            torch.compile(segmented, fullgraph=True, backend=backend)(q, k, v, a, b).backward()
    return facts


_ITEM_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1}


def _storage_bytes(shape: str, stride: str, item: int) -> int:
    sizes, strides = (tuple(int(x) for x in re.findall(r"-?\d+", t)) for t in (shape, stride))
    if any(n == 0 for n in sizes):
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(sizes, strides))) * item


_EXTERN_DTYPES = {"all_to_all": 0, "all_to_all_start": "int64", "all_to_all_wait": 1, "all_to_all_issued": 1}
"""The dtype of what each ``gdn_kcp`` exchange op returns: that of its
argument at this position (the buffer sent, the table copied), or a dtype.
``send_recv`` names its dtype among its arguments."""


def _arguments(call: str) -> list[str]:
    """The top-level arguments of the first call in ``call`` (a line of code)."""
    out, depth, start = [], 0, call.index("(") + 1
    for i in range(start, len(call)):
        c = call[i]
        if c in "([":
            depth += 1
        elif c in ")]" and depth:
            depth -= 1
        elif c in ",)" and depth == 0:
            out.append(call[start:i].strip())
            start = i + 1
            if c == ")":
                break
    return out


def _extern_dtype(line: str, dtypes: dict[str, str]) -> str | None:
    """The dtype of what the extern call on ``line`` returns: for a
    ``gdn_kcp`` exchange op, from :data:`_EXTERN_DTYPES` (``dtypes``: buffer
    -> dtype of the graph's inputs and the buffers made so far); None for any
    other op."""
    op = re.search(r"torch\.ops\.gdn_kcp\.(\w+)\.default\(", line)
    if op is None:
        return None
    literal = re.search(r"torch\.(float64|float32|bfloat16|float16|int64|int32)\b", line)
    rule = _EXTERN_DTYPES.get(op.group(1))
    if rule is None and literal:
        return literal.group(1)
    if isinstance(rule, str):
        return rule
    if rule is not None:
        base = re.match(r"(?:reinterpret_tensor\()?(\w+)", _arguments(line[op.start():])[rule])
        if base and base.group(1) in dtypes:
            return dtypes[base.group(1)]
    raise ValueError(f"no dtype known for what this call returns: {line!r}")


def planned_peak(code: str, kinds: tuple[str, ...] | None = None) -> int:
    """The most bytes the buffers of Inductor's output ``code`` hold at once
    (with ``kinds``, ``"float"`` and / or ``"int"``: of those dtypes only, a
    buffer of unknown dtype counted with the ints):
    ``empty_strided_*`` allocates; ``reinterpret_tensor(bufM, ...)`` and
    ``bufM`` alias (``# reuse`` included); ``del`` frees a buffer once no alias
    is left. A buffer an extern call returns (``torch.ops.*``,
    ``extern_kernels.*``, or item ``bufM[i]`` of one) is sized from its
    ``assert_size_stride``, an element at the dtype of a ``gdn_kcp`` exchange
    op's output (:func:`_extern_dtype`) or 8 bytes for any other op (an
    upper bound; only small index buffers here). Any other assignment to a
    buffer raises. Graph inputs are not counted; outputs stay held to the end."""
    body = code[code.index("def call("):]
    storage: dict[str, int] = {}  # buffer name -> storage id
    # buffer or graph input -> dtype, where known (the inputs' from the module's benchmark harness)
    dtypes = dict(re.findall(r"(\w+) = rand_strided\(.*dtype=torch\.(\w+)\)", code))
    size: list[int] = []
    unsized: dict[int, int] = {}  # storage id -> bytes of an element
    held = top = 0
    counted: set[int] = set()  # storage ids of the kinds asked for

    def kind_of(dtype: str | None) -> str:
        return "float" if dtype is not None and dtype.startswith(("float", "bfloat")) else "int"

    def counts(dtype: str | None) -> bool:
        return kinds is None or kind_of(dtype) in kinds

    for line in body.splitlines():
        line = line.strip()
        if line.startswith("return "):
            break
        made = re.match(r"(buf\d+) = empty_strided_\w+\((\(.*?\)), (\(.*?\)), torch\.(\w+)\)", line)
        alias = re.match(r"(buf\d+) = (?:reinterpret_tensor\()?(buf\d+)(?:\)|,|;|$|\s)", line)
        extern = re.match(r"(buf\d+) = (?:torch\.ops\.|extern_kernels\.|buf\d+\[\d+\])", line)
        checked = re.match(r"assert_size_stride\((buf\d+), (\(.*?\)), (\(.*?\))", line)
        if made:
            storage[made.group(1)] = len(size)
            dtypes[made.group(1)] = made.group(4)
            size.append(_storage_bytes(made.group(2), made.group(3), _ITEM_BYTES[made.group(4)]))
            if counts(made.group(4)):
                counted.add(len(size) - 1)
                held += size[-1]
        elif alias:
            if alias.group(2) not in storage:
                raise ValueError(f"alias of an unknown buffer: {line!r}")
            storage[alias.group(1)] = storage[alias.group(2)]
            if alias.group(2) in dtypes:
                dtypes[alias.group(1)] = dtypes[alias.group(2)]
        elif extern:
            storage[extern.group(1)] = len(size)
            dtype = _extern_dtype(line, dtypes)
            if dtype is not None:
                dtypes[extern.group(1)] = dtype
            unsized[len(size)] = 8 if dtype is None else _ITEM_BYTES[dtype]
            if counts(dtype):
                counted.add(len(size))
            size.append(0)
        elif re.match(r"buf\d+ = ", line):
            raise ValueError(f"unrecognised buffer assignment: {line!r}")
        elif checked and storage.get(checked.group(1)) in unsized:
            sid = storage[checked.group(1)]
            size[sid] = _storage_bytes(checked.group(2), checked.group(3), unsized.pop(sid))
            held += size[sid] if sid in counted else 0
        for names in re.findall(r"\bdel ((?:buf\d+)(?:, buf\d+)*)", line):
            for name in names.split(", "):
                sid = storage.pop(name, None)
                if sid is not None and sid not in storage.values() and sid in counted:
                    held -= size[sid]
        top = max(top, held)
    return top


@contextlib.contextmanager
def _captured_output_code(codes: list[str]) -> Iterator[None]:
    """Inductor's output modules go to ``codes`` instead of being loaded (their
    Triton kernels would need a GPU); calling one raises. The backward is
    compiled with the forward."""
    from torch._inductor import codecache

    def capture(cls, key, path, *args, **kwargs):
        with open(path) as source:
            codes.append(source.read())

        def call(*call_args, **call_kwargs):
            raise _Captured

        return types.SimpleNamespace(call=call, benchmark_compiled_module=None, __file__=path)

    load = codecache.PyCodeCache.__dict__["load_by_key_path"]
    codecache.PyCodeCache.load_by_key_path = classmethod(capture)
    try:
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True), \
                torch._inductor.config.patch(fx_graph_cache=False):
            yield
    finally:
        codecache.PyCodeCache.load_by_key_path = load


class _Captured(Exception):
    """Raised by a captured module's ``call``: the compile is over."""


def _output_codes(step, make_leaves) -> list[str]:
    """Inductor's forward and backward output modules of ``step(*leaves)``
    (summed and differentiated) under :func:`gdn_kcp.trace_host_path`, the
    Triton programs standing in on fake tensors (``make_leaves()`` makes
    them), captured, never run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gdn_kcp import trace_host_path
    from gdn_kcp.host.programs import use_programs

    codes: list[str] = []
    torch._dynamo.reset()
    with hopper_analysis(), use_programs("cpu", "triton"), FakeTensorMode(allow_non_fake_inputs=True), \
            _captured_output_code(codes), trace_host_path():
        try:
            torch.compile(step, fullgraph=True)(*make_leaves()).float().sum().backward()
        except Exception as error:  # the captured forward raises when it is called
            if not isinstance(error, _Captured) and "_Captured" not in repr(error):
                raise
    if len(codes) != 2:
        raise RuntimeError(f"expected a forward and a backward output module, captured {len(codes)}")
    return codes


def _bf16_leaves(T: int, H_qk: int, HV: int, K: int, V: int):
    """q, k ``[1, T, H_qk, K]``, v ``[1, T, HV, V]``, g, beta ``[1, T, HV]``: bf16 leaves."""
    leaf = dict(dtype=torch.bfloat16, requires_grad=True)
    return (torch.randn(1, T, H_qk, K, **leaf), torch.randn(1, T, H_qk, K, **leaf), torch.randn(1, T, HV, V, **leaf),
            torch.randn(1, T, HV, **leaf), torch.randn(1, T, HV, **leaf))


def peaks(codes: list[str]) -> dict:
    """:func:`planned_peak` of each graph's code: all its buffers, its float
    ones and its int ones."""
    return {"planned_peak": [planned_peak(code) for code in codes],
            "float_peak": [planned_peak(code, ("float",)) for code in codes],
            "int_peak": [planned_peak(code, ("int",)) for code in codes]}


def program_ops(names) -> list[str]:
    """Of the ``gdn_kcp`` op names in ``names`` (graph targets such as
    ``gdn_kcp.fwd.default`` or ``torch.ops.gdn_kcp.fwd`` in output code),
    those that are not boundaries (identities that run no program), sorted."""
    from gdn_kcp.ops.boundary import BOUNDARY_OPS

    found = set()
    for name in names:
        match = re.search(r"gdn_kcp\.(\w+)", name)
        if match and match.group(1) not in BOUNDARY_OPS:
            found.add(name)
    return sorted(found)


def _ops(code: str) -> list[str]:
    """The gdn_kcp ops ``code`` calls, but the boundaries."""
    return program_ops(re.findall(r"torch\.ops\.gdn_kcp\.\w+", code))


def inductor_plan(T: int = 256, H_qk: int = 1, HV: int = 2, K: int = 64, V: int = 64) -> dict:
    """Inductor's output code for a forward and backward of the FLA-style
    entry (two documents in a capped ``cu_seqlens``, bf16, in-kernel norm,
    Triton programs, fake tensors): its launches, any opaque gdn_kcp op, the
    peak of each graph's buffers, and the byte queries of the same call (the
    workspace of each call, o, the gradients, the index tables)."""
    from gdn_kcp import OptionsKcp, chunk_gated_delta_rule, gdn_workspace_bytes_kcp
    from gdn_kcp.context.builders import capped_context
    from gdn_kcp.context.sms import device_sms

    bounds = [0, T * 2 // 5, T]

    def fla(q, k, v, g, b):
        return chunk_gated_delta_rule(q, k, v, g, b, use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor(bounds))[0]

    codes = _output_codes(fla, lambda: _bf16_leaves(T, H_qk, HV, K, V))
    ctx = capped_context(torch.tensor(bounds), [(0, T)], 0, n_sms=device_sms("cpu"))
    options = OptionsKcp(use_qk_l2norm=True)
    workspace = {call: gdn_workspace_bytes_kcp(ctx, H_qk, HV, K, V, dtype=torch.bfloat16, options=options,
                                               call=call) for call in ("fwd", "bwd")}
    return {
        "launches": [code.count(".run(") for code in codes],
        "gdn_kcp_ops": [_ops(code) for code in codes],
        **peaks(codes),
        "workspace": [workspace["fwd"], workspace["bwd"]],
        "o_bytes": T * HV * V * 2,
        "grad_bytes": (2 * T * H_qk * K + T * HV * V + 2 * T * HV) * 2,
        "index_bytes": ctx.index.chunk_table.nbytes + ctx.index.frag_table.nbytes,
    }


KCP_PLAN_CASES = (
    ("a2a", 3, {}),
    ("ring", 3, {}),
    ("a2a", 2, {"boundary_mode": "replay", "schedule": "overlap"}),
    ("a2a", 3, {"save_transfer": True, "segments": 2}),
)
"""``(exchange, R, options)`` of :func:`kcp_inductor_plans`: every rank of each."""


def kcp_inductor_plans(cases=KCP_PLAN_CASES, T: int = 512, H_qk: int = 1, HV: int = 2, K: int = 64,
                       V: int = 64) -> list[dict]:
    """Inductor's output code for a forward and backward of ``gdn_kcp`` on
    every rank of ``cases`` (:data:`KCP_PLAN_CASES`; two documents, the second crossing
    every rank boundary; bf16, in-kernel norm, Triton programs, fake
    tensors), each rank compiled alone in a fake process group of R ranks
    (``torch.testing``'s: the exchanges are traced, never run). Per rank: the
    peak of each graph's buffers (:func:`planned_peak`), the exchange ops it
    calls, and the byte queries of the same call (each call's workspace, the
    saved tensors, o)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from gdn_kcp import OptionsKcp, build_kcp_context, gdn_kcp, gdn_saved_bytes_kcp, gdn_workspace_bytes_kcp

    rows = []
    for exchange, R, more in cases:
        options = OptionsKcp(use_qk_l2norm=True, exchange=exchange, **more)
        for rank in range(R):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=R)
            try:
                ctx = build_kcp_context([0, 40, T])
                lo, hi = ctx.rank_ranges[rank]
                codes = _output_codes(lambda q, k, v, g, b: gdn_kcp(q, k, v, g, b, ctx, options=options)[0],
                                      lambda: _bf16_leaves(hi - lo, H_qk, HV, K, V))
                queries = dict(dtype=torch.bfloat16, options=options)
                rows.append({
                    "case": f"{exchange} R={R} {more}", "rank": rank,
                    **peaks(codes),
                    "gdn_kcp_ops": [_ops(code) for code in codes],
                    "workspace": [gdn_workspace_bytes_kcp(ctx, H_qk, HV, K, V, call=call, **queries)
                                  for call in ("fwd", "bwd")],
                    "saved_bytes": gdn_saved_bytes_kcp(ctx, H_qk, HV, K, V, **queries),
                    "o_bytes": (hi - lo) * HV * V * 2,
                })
            finally:
                dist.destroy_process_group()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kcp-cases", default=None,
                        help="indices into KCP_PLAN_CASES, comma-separated (default: all)")
    parser.add_argument("--only-kcp", action="store_true", help="only the KCP plans")
    args = parser.parse_args()
    picked = range(len(KCP_PLAN_CASES)) if args.kcp_cases is None else map(int, args.kcp_cases.split(","))
    report = {"kcp_plans": kcp_inductor_plans([KCP_PLAN_CASES[i] for i in picked])}
    if not args.only_kcp:
        report.update(kernel_writes=kernel_writes(), graphs=traced_step(), inductor_plan=inductor_plan())
    print(json.dumps(report))


if __name__ == "__main__":
    main()
