"""OptionsKcp: every option of a KCP call, in one frozen dataclass (docs/api.md, "Options"),
and the save plan the options imply."""

from __future__ import annotations

from dataclasses import dataclass, replace

from gdn_kcp.kernels.segments import MAX_SEGMENTS

EXCHANGES = ("a2a", "ring")
SCHEDULES = ("serial", "overlap")
SAVE_MODES = ("light", "inverse", "full")
BOUNDARY_MODES = ("saved", "replay")
GRAPH_MODES = ("off", "replay")
REUSE_RECOMPUTE_TAPES = ("auto", True, False)
RECOMPUTE_OUTPUTS = ("auto", "always")
GATES = ("head", "channel")


def _check_choice(name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"OptionsKcp.{name} must be one of {choices}, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"OptionsKcp.{name} must be a bool, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class OptionsKcp:
    """Options of :func:`gdn_kcp.gdn_kcp` and of the byte queries.

    deterministic: bitwise-reproducible outputs and gradients run to run. The
        torch programs have no atomics and a fixed reduction order, so both
        values run the same path today; the ``gdn_det_*`` queries give its bytes.
    save_mode: ``"light"`` keeps no tape (the backward recomputes prep and the
        tape walk); ``"inverse"`` keeps the WY inverse A and the q/k norms
        (as flash-linear-attention does: the backward recomputes only W, U
        and the tape walk, for ``T HV C`` more saved elements); ``"full"``
        keeps the forward tapes (A, w, v_new, h and the q/k norms) and the
        backward recomputes nothing.
    boundary_mode: ``"saved"`` keeps the start state ``S_in`` of the crossing-in
        fragment (and a middle rank's M) for the backward; ``"replay"`` keeps
        nothing and the backward re-runs the summary walk and c1/c2.
    save_transfer: owners keep the M slices they received in c1 for b1, so b1
        carries no M (a2a only).
    save_for_backward: ``False`` keeps no saved set at all; the backward replays
        the forward (prep, summary, c1/c2, tape walk).
    graph: ``"replay"`` accounts for a CUDA-graph-captured call: no pool is
        released before the call ends, so every address is fixed.
    exchange: ``"a2a"`` (owner slices, per rank one summary out and one state
        in, whatever R) or ``"ring"`` (state passed along each chain; no M on the
        wire, but the ranks of a long document wait on one another).
    schedule: ``"serial"`` runs each exchange where its result is needed
        next; ``"overlap"`` (a2a) lets the backward's b2 all-to-all run under
        the tape walk it recomputes (light or inverse save mode): b1 and b2 are issued
        before that walk and b2 is waited for after it, which keeps ``dv``'s
        local pool and b2's buffers bound across the walk (the byte queries
        say what that costs). Without a recomputed walk (``save_mode="full"``)
        or an exchange it changes nothing.
    segments: intra-rank segments P (docs/kcp.md, "Intra-rank segments"): each fragment of more
        than ``ceil(n / P)`` chunks (n: the rank's longest fragment) is walked
        as segments in parallel and composed (:mod:`gdn_kcp.kernels.segments`).
        ``None`` takes the plan (:func:`gdn_kcp.plan.plan_segments`, from the
        context's metadata and SM count); an int overrides it within
        ``[1, max(1, min(64, n))]``, n the chunks of the longest fragment on
        any rank, checked against the context by every call and byte query.
    use_qk_l2norm: L2-normalise q and k per token and head inside the kernels.
    with_conv: the call belongs to a layer with a short convolution of width
        ``conv_size`` over q, k and v under KCP
        (:class:`gdn_kcp.layers.GatedDeltaNet`): the byte queries add what that
        convolution's halo costs. The saved set gains ``conv_halo``, the
        ``[conv_size - 1, 2 H_qk K + HV V]`` rows received from the previous
        rank (input dtype, on R > 1), which the convolution keeps for its
        backward; the traffic gains ``halo`` and ``halo_grad``. The workspace
        does not change: the halo exchange binds no pool of it (its tiles are
        fresh tensors, and ``gdn_kcp`` itself allocates none of them).
    conv_size: the convolution's width W (read with ``with_conv=True``).
    reuse_recompute_tapes: under a non-reentrant ``torch.utils.checkpoint``
        (:mod:`gdn_kcp.checkpointing`), torch's recompute writes the tapes a
        ``save_mode="full"`` forward keeps and the backward binds them instead
        of replaying prep and the tape walk (gradients bitwise the same).
        ``"auto"`` keeps them only when the call is the region's last
        operation that saves a tensor (its backward then runs first and the
        tapes die before any other backward); ``True`` always keeps (a later
        saver's backward then runs with the tapes held); ``False`` never.
        ``None`` (the default) is ``"auto"``, or ``False`` with
        ``graph="replay"``, which refuses ``True`` and ``"auto"``. Read
        through :attr:`reuse_tapes`; no op or byte of the workspace depends on it.
    recompute_output: ``"auto"`` (default): when the call is the region's
        last saver, torch's recompute launches no output program (torch
        discards that output); ``"always"``: it launches it.
    gate: ``"head"`` (GDN: one log decay per token and value head, g
        ``[T, HV]``) or ``"channel"`` (KDA: one per key channel, g
        ``[T, HV, K]``; the KDA entries and ``kda_*`` queries set it). The
        byte queries read it: the gate-cumsum gradient pool is ``[T, HV, K]``.

    Example: ``gdn_kcp(q, k, v, g, beta, ctx, options=OptionsKcp(save_mode="full"))``.
    """

    deterministic: bool = False
    save_mode: str = "light"
    boundary_mode: str = "saved"
    save_transfer: bool = False
    save_for_backward: bool = True
    graph: str = "off"
    exchange: str = "a2a"
    schedule: str = "serial"
    segments: int | None = None
    use_qk_l2norm: bool = False
    with_conv: bool = False
    conv_size: int = 4
    reuse_recompute_tapes: bool | str | None = None
    recompute_output: str = "auto"
    gate: str = "head"

    def __post_init__(self) -> None:
        _check_bool("deterministic", self.deterministic)
        _check_choice("save_mode", self.save_mode, SAVE_MODES)
        _check_choice("boundary_mode", self.boundary_mode, BOUNDARY_MODES)
        _check_bool("save_transfer", self.save_transfer)
        _check_bool("save_for_backward", self.save_for_backward)
        _check_choice("graph", self.graph, GRAPH_MODES)
        _check_choice("exchange", self.exchange, EXCHANGES)
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_bool("use_qk_l2norm", self.use_qk_l2norm)
        if self.segments is not None and (isinstance(self.segments, bool) or not isinstance(self.segments, int)
                                          or not 1 <= self.segments <= MAX_SEGMENTS):
            raise ValueError(
                f"OptionsKcp.segments must be None or an int in [1, {MAX_SEGMENTS}], got {self.segments!r}"
            )
        _check_bool("with_conv", self.with_conv)
        if isinstance(self.conv_size, bool) or not isinstance(self.conv_size, int) or self.conv_size < 1:
            raise ValueError(f"OptionsKcp.conv_size must be an int >= 1, got {self.conv_size!r}")
        if self.reuse_recompute_tapes is not None and not any(
                self.reuse_recompute_tapes is choice or self.reuse_recompute_tapes == choice == "auto"
                for choice in REUSE_RECOMPUTE_TAPES):
            raise ValueError(f"OptionsKcp.reuse_recompute_tapes must be one of (None, 'auto', True, False), "
                             f"got {self.reuse_recompute_tapes!r}")
        _check_choice("recompute_output", self.recompute_output, RECOMPUTE_OUTPUTS)
        _check_choice("gate", self.gate, GATES)
        if self.graph == "replay" and self.reuse_recompute_tapes in ("auto", True):
            raise ValueError(
                f"OptionsKcp.reuse_recompute_tapes={self.reuse_recompute_tapes!r} hands the backward tensors the "
                "recompute allocates, but graph='replay' fixes every address: use reuse_recompute_tapes=False")
        if self.save_mode != "light" and not self.save_for_backward:
            what = "the forward tapes" if self.save_mode == "full" else "the WY inverse and the q/k norms"
            raise ValueError(
                f"save_mode={self.save_mode!r} keeps {what}, but save_for_backward=False keeps no saved set"
            )
        if self.save_mode == "full" and self.boundary_mode == "replay":
            raise ValueError(
                "save_mode='full' keeps the tape h, which already holds the boundary state: "
                "boundary_mode='replay' has nothing to replay"
            )
        if not self.save_for_backward and self.boundary_mode == "saved":
            raise ValueError(
                "boundary_mode='saved' keeps S_in for the backward, but save_for_backward=False keeps no "
                "saved set: use boundary_mode='replay'"
            )
        if self.save_transfer and self.exchange == "ring":
            raise ValueError("save_transfer=True keeps the M slices of c1, but exchange='ring' sends no M")
        if self.schedule == "overlap" and self.exchange == "ring":
            raise ValueError("schedule='overlap' issues the all-to-all b2 ahead of the walk it overlaps, but "
                             "exchange='ring' passes states point to point: use exchange='a2a'")
        # What the ops take, computed once: torch.compile then reads a constant (the recompute options are
        # the autograd layer's alone: no op and no byte query reads them).
        object.__setattr__(self, "op_arg", options_to_str(self))

    @property
    def reuse_tapes(self) -> bool | str:
        """``reuse_recompute_tapes`` with its default resolved: ``"auto"``, ``True`` or ``False``."""
        if self.reuse_recompute_tapes is None:
            return False if self.graph == "replay" else "auto"
        return self.reuse_recompute_tapes


@dataclass(frozen=True)
class SavePlan:
    """What the forward keeps for the backward, and what the backward re-runs.

    keeps_tapes: the forward tapes are saved (save_mode="full").
    keeps_inverse: the WY inverse A and the q/k norms are saved ("inverse"
        and "full"): a backward that recomputes recomputes only W, U and h.
    keeps_s_in: the crossing-in start state is saved (light, saved boundary).
    keeps_m: a middle rank saves its own M for b1 (a kept boundary without
        save_transfer). keeps_owner_m: owners save the M slices of c1.
    replays_boundary: the backward re-runs the summary walk and c1/c2.
    """

    keeps_tapes: bool
    keeps_inverse: bool
    keeps_s_in: bool
    keeps_m: bool
    keeps_owner_m: bool
    replays_boundary: bool


def save_plan(options: OptionsKcp) -> SavePlan:
    full = options.save_mode == "full"
    keeps_boundary = options.save_for_backward and (full or options.boundary_mode == "saved")
    return SavePlan(
        keeps_tapes=full,
        keeps_inverse=options.save_mode in ("inverse", "full"),
        keeps_s_in=keeps_boundary and not full,
        keeps_m=keeps_boundary and not options.save_transfer,
        keeps_owner_m=keeps_boundary and options.save_transfer,
        replays_boundary=not keeps_boundary,
    )


WALK_OUTPUT_MAX_K = 128
"""The largest key head the walk with the output runs at. On sm_90, compiled
as a launch specialises the head dims (``compile_specs.shape_ints``), it
spills nothing at K = V = 128 and 128 x 512, but 160 B per thread at
K = V = 256 under triton 3.6 (212 under 3.9), reloaded every step: its q, w
and k slices of K / 2 columns do not fit beside the state there (1,724 B
under 3.9 without the head dims' divisibility), so at K > 128 the forward
keeps the tape walk and the output until a GPU times both."""


def walks_with_output(options: OptionsKcp, K: int) -> bool:
    """Whether a forward runs the scores and the walk with the output (no h,
    no v_new round trip) rather than the tape walk and the output: when it
    keeps no tape and ``K <= WALK_OUTPUT_MAX_K``."""
    return not save_plan(options).keeps_tapes and K <= WALK_OUTPUT_MAX_K


def kept_tape_options(options: OptionsKcp) -> OptionsKcp:
    """The options whose saved set is what a checkpoint's recompute keeps
    (``reuse_recompute_tapes``): ``save_mode="full"``'s tapes, and the M a
    kept boundary saves for b1 (the boundary state itself is in h)."""
    return replace(options, save_mode="full", boundary_mode="saved", save_for_backward=True)


def overlaps_b2(options: OptionsKcp) -> bool:
    """The backward issues b2 before the tape walk it recomputes and waits
    after it (``schedule="overlap"`` with a recomputed walk)."""
    return options.schedule == "overlap" and not save_plan(options).keeps_tapes


OPTION_NAMES = (
    "deterministic", "save_mode", "boundary_mode", "save_transfer", "save_for_backward", "graph", "exchange",
    "schedule", "segments", "use_qk_l2norm", "with_conv", "conv_size", "gate",
)


def options_to_str(options: OptionsKcp) -> str:
    """``"deterministic=False;save_mode=light;..."``: how the ops take options."""
    return ";".join(name + "=" + str(getattr(options, name)) for name in OPTION_NAMES)


def options_from_str(text: str) -> OptionsKcp:
    """The inverse of :func:`options_to_str`."""
    values: dict[str, object] = {}
    for item in text.split(";"):
        name, _, value = item.partition("=")
        if name in ("conv_size", "segments"):
            values[name] = None if value == "None" else int(value)
        else:
            values[name] = {"True": True, "False": False}.get(value, value)
    return OptionsKcp(**values)
