"""Which program backend a call runs: the torch programs on the CPU, the Triton
programs on CUDA. :func:`use_programs` swaps one for tests and checks (the
Triton programs on the CPU under ``TRITON_INTERPRET=1``, the torch programs on
CUDA as a twin, the CuTe DSL programs on CUDA: ``"cute"``, never the default)."""

from __future__ import annotations

import contextlib
import importlib
from collections import Counter
from collections.abc import Iterator
from types import ModuleType

import torch

BACKENDS = ("torch", "triton", "cute")
_backend_of = {"cpu": "torch", "cuda": "triton"}


_loaded: dict[str, ModuleType] = {}


def load_programs(device_type: str) -> ModuleType:
    """Import the backend ``device_type`` runs now (eagerly: a traced call then finds it loaded)."""
    backend = _backend_of.get(device_type, "torch")
    if backend not in _loaded:
        _loaded[backend] = importlib.import_module(f"gdn_kcp.kernels.{backend}")
    return _loaded[backend]


def programs_for(device: torch.device) -> ModuleType:
    """``gdn_kcp.kernels.torch`` or ``gdn_kcp.kernels.triton`` for ``device``.
    A loaded backend is a dict lookup, which torch.compile traces (it cannot
    trace an import)."""
    module = _loaded.get(_backend_of.get(device.type, "torch"))
    module = load_programs(device.type) if module is None else module
    return _Counting(module, _counters[-1]) if _counters else module


_counters: list[Counter] = []


class _Counting:
    """A backend whose programs count their launches by name."""

    def __init__(self, module: ModuleType, counts: Counter) -> None:
        self.module, self.counts = module, counts

    def __getattr__(self, name: str):
        program = getattr(self.module, name)

        def counted(*args, **kwargs):
            self.counts[name] += 1
            return program(*args, **kwargs)
        return counted


@contextlib.contextmanager
def count_programs() -> Iterator[Counter]:
    """Within the block, the programs that eager calls launch, counted by name
    (``prep``, ``tape_walk``, ...; the tests' and ``benchmarks/checkpoint.py``'s
    measure of what a step runs)."""
    counts: Counter = Counter()
    _counters.append(counts)
    try:
        yield counts
    finally:
        _counters.remove(counts)


@contextlib.contextmanager
def use_programs(device_type: str, backend: str) -> Iterator[None]:
    """Within the block, calls on ``device_type`` tensors run ``backend``.

    ``"cute"`` (CUDA only, ``pip install -e .[cute]``) runs the CuTe DSL
    programs where they exist (``scores``, ``w_u``, for sm_90a) and the Triton
    ones elsewhere. They are compiled and checked on the CPU and not yet run on
    a GPU, so this backend is never the default."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "cute" and device_type != "cuda":
        raise ValueError(f"backend 'cute' runs on device_type 'cuda' only, got {device_type!r}")
    previous = _backend_of.get(device_type)
    _backend_of[device_type] = backend
    try:
        yield
    finally:
        if previous is None:
            del _backend_of[device_type]
        else:
            _backend_of[device_type] = previous
