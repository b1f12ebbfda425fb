"""WorkspaceKcp: a caller-held arena of named pools, and the per-call binder.

The host path binds a pool when a program first needs it and releases it after
its last reader; every pool sits at the offset its layout gives, so one arena of
``gdn_workspace_bytes_kcp`` bytes serves both calls, step after step. Under
``graph="replay"`` nothing is released until the call ends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from gdn_kcp.context import KcpContext
from gdn_kcp.options import OptionsKcp
from gdn_kcp.dtypes import check_input_dtype
from gdn_kcp.queries.layout import CallLayout, WorkspaceLayout, gdn_workspace_layout_kcp, phase_peaks
from gdn_kcp.queries.shapes import numel

_recorders = threading.local()


class WorkspaceRecord:
    """What a recording workspace saw: every bind and release with its bytes."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, int, int]] = []  # (call, kind, name, nbytes, address)
        self.graph: dict[str, bool] = {}

    def runs(self, call: str) -> list[list[tuple[str, str, int, int]]]:
        """Every run of ``call`` ("fwd" / "bwd") in order, as ``(kind, name,
        nbytes, address)`` events."""
        out: list[list] = []
        for c, kind, name, nbytes, address in self.events:
            if c != call:
                continue
            if kind == "start":
                out.append([])
            elif kind != "end":
                out[-1].append((kind, name, nbytes, address))
        return out

    def phases(self, call: str, run: int = -1) -> dict[str, int]:
        """Peak bytes bound in each phase of a run of ``call`` (default: the last)."""
        events = self.runs(call)[run]
        sizes = {name: nbytes for kind, name, nbytes, _ in events if kind == "bind"}
        return phase_peaks([(kind, name) for kind, name, _, _ in events], sizes, self.graph[call])

    def peak(self, call: str, run: int = -1) -> int:
        return max(self.phases(call, run).values(), default=0)

    def pools(self, call: str, run: int = -1) -> dict[str, int]:
        """Bytes of every pool a run of ``call`` bound."""
        return {name: nbytes for kind, name, nbytes, _ in self.runs(call)[run] if kind == "bind"}

    def addresses(self, call: str, run: int = -1) -> dict[str, int]:
        """Address of every pool a run of ``call`` bound."""
        return {name: address for kind, name, _, address in self.runs(call)[run] if kind == "bind"}


@contextlib.contextmanager
def record_workspace() -> Iterator[WorkspaceRecord]:
    """Record every bind and release of the calls made inside the block.

    Example::

        with record_workspace() as rec:
            gdn_kcp(q, k, v, g, beta, ctx)[0].sum().backward()
        rec.phases("bwd")   # {"bwd.phase.prep": ..., ...}
    """
    record = WorkspaceRecord()
    previous = getattr(_recorders, "record", None)
    _recorders.record = record
    try:
        yield record
    finally:
        _recorders.record = previous


class Arena:
    """Binds the pools of one call over a byte storage at the layout's offsets.

    A bind checks that the pool's bytes overlap no pool still bound: a host
    path that strays from its layout fails loudly instead of corrupting data.
    """

    def __init__(self, storage: torch.Tensor, layout: CallLayout, *, graph: bool, recorded: bool = True) -> None:
        """``recorded=False``: not a call of its own for :func:`record_workspace`
        (a checkpoint's recompute writing the tapes into a backward's pools)."""
        if storage.numel() < layout.bytes:
            raise ValueError(f"workspace holds {storage.numel()} bytes, the {layout.call} call needs {layout.bytes}")
        self.storage, self.layout, self.graph = storage, layout, graph
        self.bound: dict[str, tuple[int, int]] = {}
        self.record: WorkspaceRecord | None = getattr(_recorders, "record", None) if recorded else None
        self._log("start", "", 0)
        if self.record is not None:
            self.record.graph[layout.call] = graph

    @property
    def pools(self):
        """The layout's pools: name -> spec (``shape``, ``dtype``, ...)."""
        return self.layout.pools

    def _log(self, kind: str, name: str, nbytes: int, address: int = 0) -> None:
        if self.record is not None:
            self.record.events.append((self.layout.call, kind, name, nbytes, address))

    def phase(self, name: str) -> None:
        self._log("phase", name, 0)

    def bind(self, name: str) -> torch.Tensor:
        spec = self.layout.pools.get(name)
        if spec is None:
            raise RuntimeError(f"the {self.layout.call} layout has no pool {name!r}")
        lo, hi = spec.offset, spec.offset + spec.nbytes
        for other, (o_lo, o_hi) in self.bound.items():
            if other != name and lo < o_hi and o_lo < hi and spec.nbytes and o_hi > o_lo:
                raise RuntimeError(f"pool {name!r} [{lo}, {hi}) overlaps bound pool {other!r} [{o_lo}, {o_hi})")
        if name in self.bound and not self.graph:
            raise RuntimeError(f"pool {name!r} is already bound")
        self.bound[name] = (lo, hi)
        self._log("bind", name, spec.nbytes, self.storage.data_ptr() + lo)
        element = torch.empty((), dtype=spec.dtype).element_size()
        return self.storage[lo : lo + numel(spec.shape) * element].view(spec.dtype).view(spec.shape)

    def release(self, *names: str) -> None:
        for name in names:
            self._log("release", name, 0)
            if not self.graph:
                del self.bound[name]

    def close(self) -> None:
        """End of the call: everything still bound is free again."""
        self.bound.clear()
        self._log("end", "", 0)


def adopted_view(what: str, spec, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in ``spec``'s shape, when it holds ``spec``'s elements and dtype."""
    if tensor.numel() != numel(spec.shape) or tensor.dtype != spec.dtype:
        raise RuntimeError(f"{what} is {tuple(spec.shape)} {spec.dtype}; adopted {tuple(tensor.shape)} {tensor.dtype}")
    return tensor.view(spec.shape)


class Pools:
    """The arena of a traced call: every pool is its own ``torch.empty`` of
    the layout's shape and dtype, allocated where the host path binds it.
    Same interface as :class:`Arena`; the binds and releases are the host
    path's, checked against the layout as there.

    Under ``torch.compile`` Inductor plans these buffers itself (by data
    flow). Run eagerly (``trace_host_path()`` without compile, e.g. under a
    FakeTensor ``MemTracker``), a release frees the pool's storage at once,
    whatever views of it the host path still holds, so the pools held at
    any moment are the layout's: their peak is ``CallLayout.tensor_bytes``.
    With ``graph=True`` (``graph="replay"``) nothing is freed before
    :meth:`close`, and a pool bound again is the same tensor, as in the arena."""

    def __init__(self, call: str, pools: dict, device: torch.device, *, graph: bool = False) -> None:
        """``pools``: name -> spec (``shape``, ``dtype``) of the ``call``'s layout."""
        self.call, self.pools, self.device, self.graph = call, pools, device, graph
        self.bound: set[str] = set()
        self.tensors: dict[str, torch.Tensor] = {}

    def phase(self, name: str) -> None:
        pass

    def _claim(self, name: str):
        """The spec of pool ``name``, now bound (checked against the layout)."""
        spec = self.pools.get(name)
        if spec is None:
            raise RuntimeError(f"the {self.call} layout has no pool {name!r}")
        if name in self.bound:
            raise RuntimeError(f"pool {name!r} is already bound")
        self.bound.add(name)
        return spec

    def bind(self, name: str) -> torch.Tensor:
        spec = self._claim(name)
        if name not in self.tensors:
            self.tensors[name] = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
        return self.tensors[name]

    def adopt(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Bind ``tensor`` (what the traced path computed for the pool: an
        exchange's output, a pack; any shape with the pool's elements and
        dtype) as pool ``name``: the tensor is the pool, not copied into one."""
        self.tensors[name] = adopted_view(f"pool {name!r}", self._claim(name), tensor)
        return self.tensors[name]

    def release(self, *names: str) -> None:
        for name in names:
            self.bound.remove(name)
            if not self.graph:
                self._free(self.tensors.pop(name))

    def hand_over(self, name: str) -> torch.Tensor:
        """Release pool ``name`` without freeing it: its tensor leaves the
        arena as an output of the call (the traced forward's o is the U pool
        its walk overwrote), so neither this release nor :meth:`close` frees it."""
        self.bound.remove(name)
        return self.tensors.pop(name)

    def close(self) -> None:
        self.bound.clear()
        for tensor in self.tensors.values():
            self._free(tensor)
        self.tensors.clear()

    @staticmethod
    def _free(tensor: torch.Tensor) -> None:
        if not torch.compiler.is_compiling():  # traced, the graph's data flow frees it
            tensor.untyped_storage().resize_(0)


class WorkspaceKcp:
    """A caller-held arena for the KCP calls of one (context, shapes, dtype, options).

    ``WorkspaceKcp(ctx, H_qk, HV, K, V, dtype=torch.bfloat16, options=opts)``
    allocates ``layout.bytes`` (= ``gdn_workspace_bytes_kcp``) once; pass it to
    every :func:`gdn_kcp.gdn_kcp` call of that layer, forward and backward, step
    after step. Nothing stays bound between calls, so a step binds exactly what
    the first one did; with ``graph="replay"`` every pool keeps its address.
    On a capped context (``build_kcp_context(..., max_docs=)``) the layout is
    a function of the caps, so one workspace serves every packing of a run.
    """

    def __init__(
        self,
        ctx: KcpContext,
        H_qk: int,
        HV: int,
        K: int,
        V: int,
        *,
        dtype: torch.dtype = torch.float32,
        options: OptionsKcp | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.options = options or OptionsKcp()
        self.key = (ctx.layout_key, H_qk, HV, K, V, check_input_dtype(dtype), self.options)
        self.layout: WorkspaceLayout = gdn_workspace_layout_kcp(ctx, H_qk, HV, K, V, dtype=dtype, options=options)
        self.storage = torch.empty(self.layout.bytes, dtype=torch.uint8, device=device)
        self.nbytes = self.layout.bytes
        self.ranks_agreed = ctx.R == 1  # set by the first eager gdn_kcp call through it (one all-gather)

    def arena(self, call: str) -> Arena:
        return Arena(self.storage, getattr(self.layout, call), graph=self.options.graph == "replay")
