"""Activation checkpointing without the double work (docs/api.md, "Activation checkpointing").

Under a non-reentrant ``torch.utils.checkpoint`` the region runs twice: the
forward, then torch's recompute inside ``.backward()``, whose outputs are
thrown away; a light backward then replays prep and the tape walk, which the
recompute has just run. The probe here reads which pass a call is in from
torch's checkpoint frame, so that the recompute can write the tapes the
backward needs (``OptionsKcp.reuse_recompute_tapes``) and launch no output
program when nothing reads it (``OptionsKcp.recompute_output``).

What the probe reads is private to ``torch.utils.checkpoint``: the top
saved-tensor hooks (``torch._C._autograd._top_saved_tensors_default_hooks``),
told apart by the code objects of the checkpoint's and of the recompute's
pack hooks, their closure cells (the frame, the graph task id), the frame's
``weak_holders``, ``recomp_counter`` and ``early_stop``, and
``torch._C._current_autograd_node``. It fails closed: a lookup that fails, a
torch release outside :data:`VERIFIED_TORCH`, a traced call, a reentrant
checkpoint or no grad take the ordinary path (the recompute runs the forward
as it ran, the backward replays), and :func:`last_checkpoint_record` says why.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

VERIFIED_TORCH = ("2.13",)
"""The torch releases (major.minor) whose checkpoint internals the tests run the probe on."""


@dataclass
class CheckpointRecord:
    """What the probe found on the last eager call (:func:`last_checkpoint_record`).

    phase: ``"none"`` (no non-reentrant checkpoint around the call),
        ``"forward"`` (the checkpointed forward), ``"recompute"`` (torch's
        recompute in the backward) or ``"unknown"`` (a lookup failed).
    executable: grad is enabled and an input requires grad (the call records a node).
    early_stop: the checkpoint stops its recompute at the region's last save.
    saves_left: holders of the region not yet recomputed when the call ran
        (recompute), or None. saves: the tensors this call saves.
    last_saver: the call is the region's last operation that saves a tensor
        (``saves_left == saves`` with early stop).
    triggered_by_node: the recompute was started by this call's own backward.
    kept_tapes: the recompute wrote the tapes and handed them to the backward.
    output_skipped: the recompute launched no output program.
    tapes_in_workspace: the kept tapes went into their pools of the call's
        backward workspace, allocated by the recompute rather than after it
        (the region's last saver: its backward runs next; nothing is held
        beyond what the replay holds).
    kept_bytes: the bytes of kept tapes held as tensors of their own beyond
        what the call saves anyway (a later saver with ``True``:
        ``gdn_checkpoint_bytes_kcp(...).kept_tapes``; 0 in the workspace).
    torch_release, verified: the running torch (major.minor) and whether it
        is one of :data:`VERIFIED_TORCH`.
    reasons: why the call kept or replayed, skipped or launched the output.
    """

    phase: str = "none"
    executable: bool = False
    early_stop: bool | None = None
    saves_left: int | None = None
    saves: int = 0
    last_saver: bool = False
    triggered_by_node: bool = False
    kept_tapes: bool = False
    output_skipped: bool = False
    tapes_in_workspace: bool = False
    kept_bytes: int = 0
    torch_release: str = ""
    verified: bool = False
    reasons: list[str] = field(default_factory=list)


_LAST = CheckpointRecord()


def last_checkpoint_record() -> CheckpointRecord:
    """The probe's record of the last eager GDN call (a traced call leaves it as it was)."""
    return _LAST


def torch_release() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def _pack_hook_code(hook_class) -> object | None:
    """The code object of the ``pack_hook`` a checkpoint hook class defines in its ``__init__``."""
    for const in hook_class.__init__.__code__.co_consts:
        if inspect.iscode(const) and const.co_name == "pack_hook":
            return const
    return None


def _closure(fn) -> dict[str, object]:
    return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ())}


_NODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""frame -> {index of the call's first holder: weakref to its node (ctx)}, for the calls the checkpointed forward
ran, so that the recompute finds the node whose saves it is filling."""


@dataclass
class Probe:
    """The probe's findings for one call and what the call does with them."""

    record: CheckpointRecord
    frame: object = None
    first_holder: int = -1
    node: object = None  # the original node (recompute), to hand the tapes to
    later_call: bool = False  # a later GDN call of the same region (recompute): that one keeps
    selective: bool = False  # selective checkpointing's caching mode is active (recompute)
    keep_tapes: bool = False
    skip_output: bool = False
    tapes_in_workspace: bool = False
    """Keep the tapes in the pools of the call's backward workspace (the
    region's last saver: that backward runs next), not as tensors of their own."""

    def register(self, ctx) -> None:
        """The checkpointed forward's node: found again by the recompute at the same holder index."""
        if self.record.phase == "forward" and self.frame is not None:
            _NODES.setdefault(self.frame, {})[self.first_holder] = weakref.ref(ctx)


def _selective_modes() -> tuple[type, ...]:
    """The dispatch modes of selective activation checkpointing (they record
    the forward's ops, then serve the recompute from that record)."""
    from torch.utils import checkpoint

    return tuple(getattr(checkpoint, name) for name in ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode")
                 if hasattr(checkpoint, name))


def _checkpoint_state(record: CheckpointRecord):
    """``(phase, frame, gid)`` from the top saved-tensor hooks."""
    from torch.utils import checkpoint

    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return "none", None, None
    pack = inspect.unwrap(hooks[0])
    code = getattr(pack, "__code__", None)
    if code is not None and code is _pack_hook_code(checkpoint._checkpoint_hook):
        return "forward", _closure(pack)["frame"], None
    if code is not None and code is _pack_hook_code(checkpoint._recomputation_hook):
        cells = _closure(pack)
        return "recompute", cells["target_frame_ref"](), cells["gid"]
    record.reasons.append("the saved-tensor hooks are not a non-reentrant checkpoint's")
    return "none", None, None


def probe(inputs: tuple, n_saves: int, options) -> Probe:
    """Where the call stands in a checkpoint, and whether its recompute keeps
    the tapes and skips the output (``options``: the call's :class:`OptionsKcp`)."""
    global _LAST
    record = CheckpointRecord(saves=n_saves, torch_release=torch_release())
    record.verified = record.torch_release in VERIFIED_TORCH
    record.executable = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)
    found = Probe(record)
    _LAST = record
    try:
        phase, frame, gid = _checkpoint_state(record)
        record.phase = phase
        if phase == "none":
            if not record.reasons:
                record.reasons.append("no non-reentrant checkpoint around the call")
            return found
        record.early_stop = bool(frame.early_stop)
        if phase == "forward":
            found.frame, found.first_holder = frame, len(frame.weak_holders)
            record.reasons.append("the checkpointed forward: the node is registered for the recompute")
            return found
        next_holder = frame.recomp_counter[gid]
        record.saves_left = len(frame.weak_holders) - next_holder
        record.last_saver = record.early_stop and record.saves_left == n_saves
        nodes = _NODES.get(frame, {})
        ref = nodes.get(next_holder)
        found.node = ref() if ref is not None else None
        found.later_call = any(i > next_holder and r() is not None for i, r in nodes.items())
        record.triggered_by_node = found.node is not None and torch._C._current_autograd_node() is found.node
        found.selective = any(type(mode) in _selective_modes() for mode in _get_current_dispatch_mode_stack())
    except Exception as error:  # private internals: any surprise takes the ordinary path
        record.phase = "unknown"
        record.reasons.append(f"the checkpoint frame could not be read ({type(error).__name__}: {error})")
        return found
    _decide(found, options)
    return found


def _decide(found: Probe, options) -> None:
    """The recompute's choices, each with its reason in the record."""
    record = found.record
    blockers = []
    if not record.verified:
        blockers.append(f"torch {record.torch_release} is not a verified release {VERIFIED_TORCH}")
    if not record.executable:
        blockers.append("the call records no node (no grad, or no input requires grad)")
    if found.node is None:
        blockers.append("the recompute found no node of the checkpointed forward at this call's holders")
    if options.graph == "replay":
        blockers.append("graph='replay' fixes every address: the recompute runs the forward as it ran")
    if found.selective:
        blockers.append("selective checkpointing replays the forward's ops from its cache: the recompute runs "
                        "the forward as it ran")
    reuse = options.reuse_tapes
    if blockers:
        record.reasons.extend(blockers)
    elif options.save_mode == "full":
        record.reasons.append("save_mode='full' saves the tapes itself: the recompute writes them")
    elif reuse is False:
        record.reasons.append("reuse_recompute_tapes=False: the backward replays")
    elif found.later_call:
        record.reasons.append("replayed: a later GDN call of the region keeps its tapes (one kept set at a time)")
    elif reuse is True or (record.last_saver and record.triggered_by_node):
        found.keep_tapes = True
        record.reasons.append("kept: " + ("reuse_recompute_tapes=True" if reuse is True else
                                          "the region's last saver, its backward the first to run"))
    else:
        record.reasons.append("replayed: " + ("a later operation of the region saves tensors"
                                              if not record.last_saver else
                                              "the recompute was not started by this call's backward"))
    if blockers or options.recompute_output == "always":
        if options.recompute_output == "always":
            record.reasons.append("recompute_output='always': the output is launched")
    elif record.last_saver and record.triggered_by_node:
        found.skip_output = True
        record.reasons.append("output skipped: the region's last saver, its output read by nothing")
    else:
        record.reasons.append("output launched: a later operation of the region may read it")
    found.tapes_in_workspace = found.keep_tapes and record.last_saver and record.triggered_by_node
    record.kept_tapes, record.output_skipped = found.keep_tapes, found.skip_output
    record.tapes_in_workspace = found.tapes_in_workspace


_LIVE: list = []
"""The node holding the one kept tape set (a weakref), so that a second keep drops the first."""


def hand_over(node, tapes: tuple[str, object]) -> None:
    """Give ``tapes`` (``("workspace", storage)`` or ``("tapes", tensors)``) to
    ``node``'s backward; a node that held a kept set before falls back to the
    replay (a safety net: the probe lets only a region's last GDN call keep)."""
    if _LIVE and (previous := _LIVE[0]()) is not None and previous is not node:
        previous.kept_tapes = None
    _LIVE[:] = [weakref.ref(node)]
    node.kept_tapes = tapes


def checkpoint_policy(save: tuple[str, ...] = ("fwd", "forward_boundary")):
    """A policy for selective activation checkpointing
    (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) over
    the package's ops: ``gdn_kcp::<name>`` for each name of ``save`` is
    ``MUST_SAVE`` (its outputs are kept, the recompute does not run it),
    every other op ``PREFER_RECOMPUTE``. The names:

    - ``"fwd"``: the opaque forward, ``gdn_kcp::fwd``. A compiled checkpoint
      then recomputes the projections around it but not GDN, and keeps its
      output and saved set (what a region without checkpoint keeps of GDN).
    - ``"forward_boundary"``: o, the final states and the saved layout on
      the traced host path (:func:`gdn_kcp.trace_host_path`,
      :mod:`gdn_kcp.ops.boundary`), as one op's outputs. The policy sees every
      program's op there (``gdn_kcp::prep``, ``scores``, ``walk_output``, ...)
      before it decomposes, but tags every node of its decomposition alike;
      this op is exactly what the forward hands on. The compiled backward
      then replays what the call's backward replays (light: prep and the tape
      walk) and not the output.

    The default saves both, so one policy serves either path and the
    compiled region keeps of GDN what the step without checkpoint keeps
    (tests/test_compiled_saved.py). Example::

        from functools import partial
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
        context_fn = partial(create_selective_checkpoint_contexts, gdn_kcp.checkpoint_policy())
        y = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
    """
    from torch.utils.checkpoint import CheckpointPolicy

    names = ("fwd", "forward_boundary")
    if isinstance(save, str) or not all(name in names for name in save):
        raise ValueError(f"save must be a tuple of gdn_kcp op names {names}, got {save!r}")
    saved = frozenset(save)

    def policy(ctx, op, *args, **kwargs):
        if getattr(op, "namespace", None) == "gdn_kcp" and getattr(op, "_opname", None) in saved:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return policy
