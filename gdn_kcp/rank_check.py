"""``GDN_KCP_CHECK_RANKS=1``: a debug check that every rank of a KCP call agrees.

Why: a rank whose inputs disagree with the others' (another token count, head
count, dtype or option) raises in its own input checks while the other ranks
enter the first exchange of the call and wait there until the process group
times out; with another HV or dtype the collectives of the ranks differ in size
(gloo aborts), and with another ``use_qk_l2norm`` the ranks silently mix two
computations. With the switch on, :func:`gdn_kcp.gdn_kcp` first all-gathers a
few int64 facts of every rank, before any local check can raise, so every rank
raises the same ``ValueError`` at once, naming the field and the ranks.

The variable is read on every call (a dict lookup), so it can be set after
import. The check is an eager debugging aid: it costs one small all-gather and
one host sync per forward call, and it is skipped while ``torch.compile``
traces (and under FakeTensorMode). Switched off, it runs no collective.
"""

from __future__ import annotations

import math
import os
import struct

import torch
import torch.distributed as dist

from gdn_kcp.call_checks import check_kcp_inputs, resolve_options
from gdn_kcp.context import KcpContext
from gdn_kcp.groups import digest, group_device
from gdn_kcp.options import BOUNDARY_MODES, EXCHANGES, GATES, GRAPH_MODES, OPTION_NAMES, SAVE_MODES, SCHEDULES
from gdn_kcp.validate import qk_norm_flag

ENV_VAR = "GDN_KCP_CHECK_RANKS"
ON_VALUES = ("1", "true", "yes", "on")

_INT, _WORD, _FLOAT, _DIGEST = "int", "word", "float", "digest"
_ABSENT = -1  # an int fact of an input that is not a tensor of enough dims


def check_ranks_enabled() -> bool:
    """True when ``GDN_KCP_CHECK_RANKS`` is one of ``1, true, yes, on``."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ON_VALUES


def _dim(x: object, i: int) -> int:
    return int(x.shape[i]) if isinstance(x, torch.Tensor) and x.dim() > i else _ABSENT


def _dtype_word(x: object) -> str:
    return str(x.dtype).removeprefix("torch.") if isinstance(x, torch.Tensor) else "absent"


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _context_digest(ctx: KcpContext) -> int:
    """The group-wide part of the context (every rank's view of it is the same)."""
    shared = (ctx.group_name, ctx.R, ctx.n_docs, ctx.rank_ranges, ctx.rank_n_in, ctx.rank_n_out,
              ctx.rank_middle, ctx.rank_prev, ctx.rank_next, ctx.chains, ctx.packing_digest)
    return digest(shared)


def _local_checks(ctx, q, k, v, g, beta, arguments: dict):
    """``(resolved options or None, the error gdn_kcp's own checks raise or None)``."""
    resolved = None
    try:
        flag, name = qk_norm_flag(arguments["use_qk_l2norm_in_kernel"], arguments["use_qk_l2norm"])
        resolved = resolve_options(arguments["options"], flag, name)
        check_kcp_inputs(q, k, v, g, beta, ctx, **arguments)
    except (TypeError, ValueError) as err:
        return resolved, err
    return resolved, None


def _facts(ctx, q, k, v, g, beta, scale, resolved, initial_state, output_final_state, gate_kwargs):
    """``(name, kind, code)`` of every fact that must be equal on every rank."""
    K = _dim(q, 3)
    try:
        effective_scale = float(K**-0.5 if scale is None else scale)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError):
        effective_scale = math.nan
    facts = [
        ("context", _DIGEST, _context_digest(ctx)),
        ("B", _INT, _dim(q, 0)),
        ("H_qk", _INT, _dim(q, 2)),
        ("K", _INT, K),
        ("HV", _INT, _dim(v, 2)),
        ("V", _INT, _dim(v, 3)),
        ("dtype", _WORD, _dtype_word(q)),
        ("g.dtype", _WORD, _dtype_word(g)),
        ("beta.dtype", _WORD, _dtype_word(beta)),
        ("device", _WORD, q.device.type if isinstance(q, torch.Tensor) else "absent"),
        ("scale", _FLOAT, _float_bits(effective_scale)),
        ("initial_state", _INT, int(initial_state is not None)),
        ("output_final_state", _INT, int(bool(output_final_state))),
    ]
    for name in ("use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval"):
        facts.append((name, _INT, int(bool(gate_kwargs.get(name, False)))))
    for name in OPTION_NAMES:
        facts.append((name, _WORD, "invalid" if resolved is None else str(getattr(resolved, name))))
    return facts


def _show(kind: str, code: int, words: dict[int, str]) -> str:
    if kind == _INT:
        return "absent" if code == _ABSENT else str(code)
    if kind == _FLOAT:
        value = struct.unpack("<d", struct.pack("<q", code))[0]
        return "invalid" if math.isnan(value) else repr(value)
    return words.get(code, "another value")


def _vocabulary() -> list[str]:
    """Words another rank may have sent: dtype and device names, option values."""
    dtypes = [str(x).removeprefix("torch.") for x in vars(torch).values() if isinstance(x, torch.dtype)]
    return [*dtypes, "cpu", "cuda", "meta", "absent", "invalid", "True", "False", "None",
            *SAVE_MODES, *BOUNDARY_MODES, *GRAPH_MODES, *EXCHANGES, *SCHEDULES, *GATES,
            *(str(n) for n in range(1, 65))]  # conv_size, segments


def check_ranks_agree(
    ctx: object,
    q: object,
    k: object,
    v: object,
    g: object,
    beta: object,
    *,
    scale: object = None,
    options: object = None,
    use_qk_l2norm_in_kernel: object = None,
    use_qk_l2norm: object = None,
    workspace: object = None,
    initial_state: object = None,
    output_final_state: object = False,
    gate_kwargs: dict | None = None,
    first_workspace_call: bool = False,
) -> bool:
    """With ``GDN_KCP_CHECK_RANKS=1`` (or ``first_workspace_call``: the first
    eager call through a held :class:`~gdn_kcp.WorkspaceKcp`), check that every rank of ``ctx.group``
    calls :func:`gdn_kcp.gdn_kcp` with the same context, B, H_qk, K, HV, V,
    dtypes (q/k/v, g, beta), device type, scale, options, initial-state and
    final-state use, and a token count T equal to its context range; and that
    no rank's inputs fail gdn_kcp's own checks while another's pass. Takes the
    arguments of gdn_kcp as given (unchecked): a rank with malformed inputs
    still joins the one all-gather of ``[n_facts]`` int64. Every rank raises
    the same ``ValueError`` naming the fields and ranks that differ. A no-op
    when the switch is off, while torch.compile traces, under FakeTensorMode,
    on one rank, or when ``ctx`` is not a :class:`KcpContext`. Returns True
    when the ranks were checked and agree, or there is nothing to check (one
    rank); False when the check was skipped (off, traced or fake).

    Example (every rank raises, rank 1 passed 500 of its 512 tokens)::

        GDN_KCP_CHECK_RANKS=1 torchrun --nproc-per-node 2 train.py
        ValueError: GDN_KCP_CHECK_RANKS: ranks [1] pass a token count T that disagrees
        with the context (rank 1: T = 500, rank_ranges[1] = (512, 1024) holds 512)
    """
    if torch.compiler.is_compiling() or not (check_ranks_enabled() or first_workspace_call):
        return False
    if not isinstance(ctx, KcpContext) or ctx.R == 1 or not (dist.is_available() and dist.is_initialized()):
        return True
    if torch._guards.detect_fake_mode([x for x in (q, k, v, g, beta) if isinstance(x, torch.Tensor)]) is not None:
        return False

    arguments = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_qk_l2norm=use_qk_l2norm, options=options,
                     workspace=workspace, gate_kwargs=gate_kwargs or {})  # gate_keywords' defaults
    resolved, local_error = _local_checks(ctx, q, k, v, g, beta, arguments)
    facts = _facts(ctx, q, k, v, g, beta, scale, resolved, initial_state, output_final_state,
                   arguments["gate_kwargs"])
    words = {digest(w): w for w in _vocabulary()}
    shared_codes = []
    for name, kind, value in facts:
        if kind == _WORD:
            words[digest(value)] = value
            value = digest(value)
        shared_codes.append(value)
    # Facts checked per rank: its token count against its context range, the
    # rank its context was built for, and whether its own input checks pass.
    own_codes = [_dim(q, 1), ctx.rank, int(local_error is None)]

    world = dist.get_world_size(ctx.group)
    mine = torch.tensor(shared_codes + own_codes, dtype=torch.int64, device=group_device(ctx.group))
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=ctx.group)
    rows = torch.stack(gathered).cpu().tolist()  # a debug aid: one host sync is its price

    problems = []
    differences: dict[tuple[int, ...], list[str]] = {}  # fields by the ranks that differ in them
    for column, (name, kind, _) in enumerate(facts):
        differ = [r for r in range(world) if rows[r][column] != rows[0][column]]
        if not differ:
            continue
        if kind == _DIGEST:
            problems.append(
                f"ranks {differ} hold another {name} than rank 0 (R, rank_ranges, crossing flags, caps or the "
                f"packing differ: build it with the same cu_seqlens_global, group, rank_ranges and max_docs "
                f"on every rank)"
            )
            continue
        theirs = ", ".join(dict.fromkeys(_show(kind, rows[r][column], words) for r in differ))
        differences.setdefault(tuple(differ), []).append(
            f"{name} ({_show(kind, rows[0][column], words)} vs {theirs})"
        )
    for differ, fields in differences.items():
        problems.append(f"ranks {list(differ)} differ from rank 0 in {', '.join(fields)}")
    T_column, rank_column, ok_column = (len(facts) + i for i in range(3))

    def holds(r: int) -> int:
        start, end = ctx.rank_ranges[r] if r < len(ctx.rank_ranges) else (0, -1)
        return end - start

    wrong_T = [r for r in range(world) if rows[r][T_column] != holds(r)]
    if wrong_T:
        detail = ", ".join(
            f"rank {r}: T = {_show(_INT, rows[r][T_column], words)}, rank_ranges[{r}] = "
            f"{ctx.rank_ranges[r] if r < len(ctx.rank_ranges) else 'absent'} holds {max(holds(r), 0)}"
            for r in wrong_T
        )
        problems.append(f"ranks {wrong_T} pass a token count T that disagrees with the context ({detail})")
    wrong_rank = [r for r in range(world) if rows[r][rank_column] != r]
    if wrong_rank:
        problems.append(
            f"ranks {wrong_rank} pass a context built for another rank ("
            + ", ".join(f"rank {r} holds ctx.rank = {rows[r][rank_column]}" for r in wrong_rank) + ")"
        )
    failed = [r for r in range(world) if rows[r][ok_column] == 0]
    if failed and len(failed) < world:  # failing everywhere: every rank raises its own error anyway
        me = dist.get_rank(ctx.group)
        own = f" (rank {me}: {type(local_error).__name__}: {local_error})" if local_error else ""
        problems.append(f"the inputs of ranks {failed} fail gdn_kcp's input checks{own}")
    if problems:
        what = ENV_VAR if check_ranks_enabled() else "the first call through this WorkspaceKcp"
        raise ValueError(f"{what}: " + "; ".join(problems)) from local_error
    return True
