"""Every program of the host path as its own op: ``gdn_kcp::<program>``.

Each op is a ``torch.library.triton_op`` whose body runs the program of the
tensors' device (:mod:`gdn_kcp.host.programs`: the Triton programs on CUDA,
launched through ``wrap_triton``; the torch programs on the CPU, a device
branch of the same body). Its schema is the program's signature with the
:class:`ChunkIndex` spread into its two tables and four ints; the
``*_out`` / ``*_acc`` buffers are its mutated arguments and it returns
nothing, so every output is a buffer the host path bound, shaped by the
layout query (:class:`gdn_kcp.workspace.Pools`).

What each part of torch does with them:

- **Eager** (``backend_fn``): the program runs on real tensors, launches
  straight to the kernels.
- **Fake kernel** (Dynamo's trace, ``FakeTensorMode``, ``MemTracker``): the
  same body on fake tensors; a Triton launch is a no-op, the torch program
  runs on fakes with its traced (fixed-shape) writes.
- **AOT autograd / Inductor**: the op decomposes into its body. On CUDA each
  launch becomes a ``triton_kernel_wrapper_functional`` that clones only
  what the kernel writes; on the CPU the torch program's ops land in
  Inductor's own C++ kernels.
- **torch.export** keeps the ops as they are (named, serialisable).

The host path calls them through :data:`PROGRAM_OPS` (same names and
signatures as ``gdn_kcp.kernels.torch``) when its pools are
:class:`~gdn_kcp.workspace.Pools`, i.e. on the traced host path.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Optional

import torch

from gdn_kcp.host.programs import programs_for
from gdn_kcp.kernels import ChunkIndex
from gdn_kcp.kernels import torch as torch_programs
from gdn_kcp.kernels.tracing import tracing

HOST_PROGRAMS = (
    "prep", "w_u", "summary_walk", "channel_decays", "tape_walk", "output", "scores", "walk_output",
    "segment_summary", "compose_segments",
    "bwd_local_dv", "adjoint_summary", "adjoint_walk", "bwd_dqkwg", "bwd_wy", "bwd_gate_cumsum", "bwd_qk_norm",
    "adjoint_segment_summary", "compose_adjoints",
)
"""The programs the host path runs (decode and the short convolution have ops of their own)."""

INDEX_FIELDS = (
    ("chunk_table", torch.Tensor), ("frag_table", torch.Tensor),
    ("n_tokens", int), ("n_chunks", int), ("n_frag", int), ("max_frag_chunks", int),
)
"""A :class:`ChunkIndex` as op arguments, in its field order."""

POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD

ANNOTATIONS = {
    "torch.Tensor": torch.Tensor, "torch.Tensor | None": Optional[torch.Tensor],
    "int": int, "float": float, "bool": bool,
}


def mutated(name: str) -> bool:
    """Program arguments a program writes: its ``*_out`` buffers and ``*_acc`` accumulators."""
    return name.endswith(("_out", "_acc"))


def op_signature(program) -> inspect.Signature:
    """``program``'s arguments, all positional (custom ops take no keyword-only
    tensors), with the index spread (:data:`INDEX_FIELDS`) and real types,
    for ``infer_schema``. Defaults are the caller's (:func:`define_program_op`)."""
    parameters = []
    for p in inspect.signature(program).parameters.values():
        if p.annotation == "ChunkIndex":
            parameters += [inspect.Parameter(f"index_{name}", POSITIONAL, annotation=kind)
                           for name, kind in INDEX_FIELDS]
            continue
        if p.annotation not in ANNOTATIONS:
            raise TypeError(f"{program.__name__}: argument {p.name} has no op type ({p.annotation!r})")
        parameters.append(inspect.Parameter(p.name, POSITIONAL, annotation=ANNOTATIONS[p.annotation]))
    return inspect.Signature(parameters, return_annotation=None)


def wrap_triton_enabled() -> bool:
    """True in an op body run on fake or functional tensors: triton_op's
    eager backend turns ``wrap_triton`` off around the body, the fake kernel
    and AOT autograd's decomposition leave it on. (A torch without the
    switch traces every launch, eager ones too: correct, slower.)"""
    enabled = getattr(torch._library.triton, "is_wrap_triton_enabled", None)
    return True if enabled is None else enabled()


def define_program_op(name: str):
    """``gdn_kcp::<name>`` and the caller the host path uses: the program's own
    signature (keywords and defaults), every argument passed to the op in order."""
    program = getattr(torch_programs, name)
    params = list(inspect.signature(program).parameters.values())
    names = [p.name for p in params]
    at = next((i for i, p in enumerate(params) if p.annotation == "ChunkIndex"), None)
    fields = len(INDEX_FIELDS)
    keywords = [p.name for p in params if p.kind == inspect.Parameter.KEYWORD_ONLY]

    def body(*args) -> None:
        with tracing(wrap_triton_enabled()):
            if at is not None:
                args = (*args[:at], ChunkIndex(*args[at:at + fields]), *args[at + fields:])
            device = next(x for x in args if isinstance(x, torch.Tensor)).device
            positional = len(args) - len(keywords)
            getattr(programs_for(device), name)(*args[:positional], **dict(zip(keywords, args[positional:])))

    body.__name__ = body.__qualname__ = name
    body.__signature__ = op_signature(program)
    op = torch.library.triton_op(f"gdn_kcp::{name}", body, mutates_args=[n for n in names if mutated(n)])

    def call(*args, **kwargs) -> None:
        unknown = set(kwargs) - set(names[len(args):])
        if unknown:
            raise TypeError(f"{name}() got unexpected keyword arguments {sorted(unknown)}")
        values = [*args, *(kwargs.get(p.name, p.default) for p in params[len(args):])]
        missing = [n for n, x in zip(names, values) if x is inspect.Parameter.empty]
        if missing:
            raise TypeError(f"{name}() missing arguments {missing}")
        if at is not None:
            index = values[at]
            values[at:at + 1] = (index.chunk_table, index.frag_table, index.n_tokens, index.n_chunks, index.n_frag,
                                 index.max_frag_chunks)
        op(*values)

    call.__name__, call.__doc__ = name, f"``gdn_kcp::{name}`` with the signature of the program ``{name}``."
    return call


PROGRAM_OPS = SimpleNamespace(**{name: define_program_op(name) for name in HOST_PROGRAMS})
"""The host path's programs as ops: ``PROGRAM_OPS.prep(q, k, ..., index, A_out=...)``."""
