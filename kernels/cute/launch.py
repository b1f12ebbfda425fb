"""The host side of a CuTe program: its launch as data (:class:`Launch`), the
fake tensors it compiles against and the runtime tensors it is called with.

A launch lists the program's tensors in kernel order (an absent optional
tensor replaced by a spare, as the Triton launchers' ``pointer``), each with
the dim that is symbolic at compile time: the token dim ``T`` of
``[T, ...]`` tensors, the chunk dim of the ``[3, n_chunks]`` chunk table.
Everything else (heads, K, V, dtypes, flags) is static, so one compile
serves every packing of a run. The same launch builds the fake tensors
(``cute.runtime.make_fake_compact_tensor``, what the CPU checks compile) and
the runtime tensors (``from_dlpack``), so what is compiled is what is called.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import cutlass.cute as cute
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor, make_fake_stream

from ._common import compile_options, compiled, element

TOKENS = 0
"""The symbolic dim of a token-layout tensor."""
CHUNKS = 1
"""The symbolic dim of the chunk table."""


@dataclass(frozen=True)
class Launch:
    """One program launch: ``program`` (a ``cute.jit`` callable), its ``key``
    (what it is specialised to), ``names`` and ``tensors`` in kernel order,
    the symbolic dim of each (None: all static), and the grid it launches."""

    program: object
    key: tuple
    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    symbolic: tuple[int | None, ...]
    grid: tuple[int, int, int]


def check_layout(name: str, x: torch.Tensor) -> None:
    """Programs read token layout: a contiguous tensor (a ValueError names the argument)."""
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (token layout), got strides {tuple(x.stride())}")


def fake_arguments(launch: Launch) -> list:
    """The launch's tensors as DSL fake tensors: one symbol for every token
    dim, one for the chunk dim, compact strides (contiguous, row-major)."""
    symbols = {TOKENS: cute.sym_int32(), CHUNKS: cute.sym_int32()}
    fakes = []
    for name, x, dim in zip(launch.names, launch.tensors, launch.symbolic):
        check_layout(name, x)
        shape = tuple(symbols[dim] if d == dim else n for d, n in enumerate(x.shape))
        fakes.append(make_fake_compact_tensor(element(x.dtype), shape, stride_order=tuple(reversed(range(x.dim()))),
                                              assumed_align=x.element_size()))
    return fakes


def runtime_arguments(launch: Launch) -> list:
    """The launch's tensors as the compiled program takes them (symbolic dims dynamic)."""
    out = []
    for name, x, dim in zip(launch.names, launch.tensors, launch.symbolic):
        check_layout(name, x)
        t = from_dlpack(x, assumed_align=x.element_size())
        out.append(t if dim is None else t.mark_compact_shape_dynamic(mode=dim, stride_order=x.dim_order()))
    return out


def arg_specs(launch: Launch) -> tuple:
    """Dtype and static shape (symbolic dims as None) of every tensor: part of the compile key."""
    return tuple((x.dtype, tuple(None if d == dim else n for d, n in enumerate(x.shape)))
                 for x, dim in zip(launch.tensors, launch.symbolic))


def compile_launch(launch: Launch, arch: str | None = None):
    """``cute.compile`` of the launch's program against its fake tensors (no GPU needed)."""
    return cute.compile(launch.program, *fake_arguments(launch), make_fake_stream(), options=compile_options(arch))


def run(launch: Launch) -> None:
    """Compile once per key (and argument specs), then launch on the current CUDA stream."""
    import cuda.bindings.driver as cuda

    program = compiled((launch.key, arg_specs(launch)), lambda: compile_launch(launch))
    program(*runtime_arguments(launch), cuda.CUstream(torch.cuda.current_stream().cuda_stream))
