"""Hugging Face transformers' Gated DeltaNet and KDA models on gdn_kcp's ops.

``use_gdn_kcp()`` points the module-level ops that transformers' linear-attention
layers call (the chunked and token-by-token delta rule, and the short
convolution's prefill) at gdn_kcp's, for every family the installed
transformers ships; ``with use_gdn_kcp(): ...`` does it for the block and puts
transformers' own back after it::

    from gdn_kcp.integrations.transformers import use_gdn_kcp

    with use_gdn_kcp():
        loss = model(input_ids, labels=labels, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=n,
                     max_length_k=n, position_ids=position_ids).loss
        loss.backward()

The layers look their ops up in their modeling module at every call, so the
patch reaches models built before it as well as after. transformers is imported
here lazily: ``import gdn_kcp`` never imports it.

Packed batches (``cu_seq_lens_q``, as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
passes it) keep their documents apart in every family: the Qwen-family layers
hand the bounds to the delta rule as ``cu_seqlens``, the Kimi-family layers
leave them in the keywords they pass on, where the patched op reads them; the
short convolution restarts at each document (gdn_kcp's ``short_conv``), where
transformers' torch fallback would read across a boundary.

Key-context parallelism: within ``with kcp(ctx): ...`` (a
:class:`~gdn_kcp.KcpContext` of the packed stream, the same on every rank)
each rank feeds the model its own token range ``ctx.rank_ranges[ctx.rank]``
as one row, and every patched GDN / KDA layer runs it through
:func:`gdn_kcp.gdn_kcp` / :func:`gdn_kcp.kda_kcp`, its short convolution
reading the previous ranks' rows of a crossing-in document
(:func:`gdn_kcp.layers.halo.short_conv_kcp`), as gdn_kcp's own layers do::

    ctx = build_kcp_context(cu_seqlens, rank_ranges=ranges, group=group)
    start, end = ctx.rank_ranges[ctx.rank]
    with use_gdn_kcp(), kcp(ctx):
        loss = model(input_ids[:, start:end], shift_labels=shift_labels[:, start:end],
                     num_items_in_batch=n_targets, use_cache=False).loss
    loss.backward()   # every rank together; sum the gradients over the group
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from gdn_kcp.chunk import chunk_gated_delta_rule
from gdn_kcp.context import KcpContext
from gdn_kcp.kcp import gdn_kcp
from gdn_kcp.kda import chunk_kda, fused_recurrent_kda, kda_kcp
from gdn_kcp.layers.halo import short_conv_kcp
from gdn_kcp.layers.short_conv import short_conv
from gdn_kcp.options import OptionsKcp
from gdn_kcp.recurrent import fused_recurrent_gated_delta_rule
from gdn_kcp.validate import values_readable

SUPPORTED_VERSIONS = ("5.25", "5.26")
"""``[low, high)``: the transformers releases whose modeling code this module was
checked against (pyproject's ``transformers`` extra says the same)."""

GDN = "gated_deltanet"
KDA = "kda"

FAMILIES: dict[str, str] = {
    "qwen3_next": GDN,
    "qwen3_5": GDN,
    "qwen3_5_moe": GDN,
    "olmo_hybrid": GDN,
    "lara_mini": GDN,
    "qwen4_exp": GDN,
    "kimi_linear": KDA,
    "bailing_hybrid": KDA,
    "glm5_next": KDA,
}
"""Every family of transformers 5.25 whose linear-attention layers are GDN or
KDA, and which of the two; a family the installed release lacks is skipped."""

OP_NAMES = {
    GDN: ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    KDA: ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"),
}
CONV_NAME = "causal_conv1d_fn"

# The parameters each op of transformers 5.25 declares, in order: a family whose
# op declares others has changed its call, and is refused rather than guessed at.
EXPECTED_PARAMETERS = {
    "torch_chunk_gated_delta_rule": ("query", "key", "value", "g", "beta", "chunk_size", "initial_state",
                                     "output_final_state", "use_qk_l2norm_in_kernel", "kwargs"),
    "torch_recurrent_gated_delta_rule": ("query", "key", "value", "g", "beta", "initial_state",
                                         "output_final_state", "use_qk_l2norm_in_kernel", "kwargs"),
    "chunk_kimi_delta_attention": ("query", "key", "value", "g", "beta", "chunk_size", "initial_state",
                                   "output_final_state", "use_qk_l2norm_in_kernel", "kwargs"),
    "recurrent_kimi_delta_attention": ("query", "key", "value", "g", "beta", "initial_state",
                                       "output_final_state", "use_qk_l2norm_in_kernel", "kwargs"),
    CONV_NAME: ("hidden_states", "weight", "bias", "activation", "kwargs"),
}

SILU = ("silu", "swish")  # transformers' names of the activation gdn_kcp's short_conv fuses


def transformers_version() -> str:
    """The installed transformers' version; ``ImportError`` when there is none."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError("gdn_kcp.integrations.transformers needs transformers: "
                          "pip install 'gdn_kcp[transformers]'") from None


def check_version(version: str) -> None:
    """``RuntimeError`` for a transformers outside :data:`SUPPORTED_VERSIONS`:
    another release may call its ops otherwise, and a patch that no longer fits
    must fail loudly, not fall back."""
    from packaging.version import Version

    low, high = SUPPORTED_VERSIONS
    if not Version(low) <= Version(version) < Version(high):
        raise RuntimeError(f"gdn_kcp.integrations.transformers supports transformers >= {low}, < {high}; "
                           f"the installed one is {version}")


def torch_function(op: object) -> Callable | None:
    """The plain function behind one of transformers' module-level ops: the ops
    are hub-kernel wrappers (an ``nn.Module`` whose forward closes over a
    ``functools.wraps`` wrapper of the function), or the function itself."""
    if inspect.isfunction(op):
        return inspect.unwrap(op)
    forward = getattr(type(op), "forward", None)
    for cell in getattr(forward, "__closure__", None) or ():
        contents = cell.cell_contents
        if inspect.isfunction(contents):
            return inspect.unwrap(contents)
    return None


def installed_families() -> dict[str, str]:
    """The families of :data:`FAMILIES` the installed transformers ships, with
    their kind (``"gated_deltanet"`` or ``"kda"``)."""
    transformers_version()
    found = {}
    for family, kind in FAMILIES.items():
        if importlib.util.find_spec(f"transformers.models.{family}") is not None:
            found[family] = kind
    return found


def modeling_module(family: str):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def check_family(family: str, module) -> None:
    """``RuntimeError`` naming the family and the op when a modeling module
    lacks an op this patch replaces or declares other parameters for it."""
    for name in (*OP_NAMES[FAMILIES[family]], CONV_NAME):
        op = getattr(module, name, None)
        if op is None:
            raise RuntimeError(f"transformers' {family} has no module-level {name}: its layers have changed "
                               "how they call their ops, and gdn_kcp cannot route them")
        if getattr(op, "gdn_kcp_family", None) is not None:
            continue  # already ours (a nested use_gdn_kcp)
        function = torch_function(op)
        found = tuple(inspect.signature(function).parameters) if function is not None else None
        if found != EXPECTED_PARAMETERS[name]:
            raise RuntimeError(f"transformers' {family}.{name} declares parameters {found}, gdn_kcp expects "
                               f"{EXPECTED_PARAMETERS[name]}: its call has changed, and gdn_kcp will not guess")


MODEL_KEYWORDS = frozenset({"use_cache", "cache_position", "return_dict", "position_embeddings", "shift_labels"})
"""Keywords a model's forward hands down through its layers besides
``TransformersKwargs`` (flags, rotary tables, and ``shift_labels``, the
loss's targets already shifted, which context-parallel training passes so
that a rank's last token is scored against the next rank's first: nothing
about which tokens share a document)."""


def transformers_keywords() -> frozenset:
    """The keywords transformers' layers pass on to their ops unasked:
    ``TransformersKwargs`` (the flash-attention ones among them) and
    :data:`MODEL_KEYWORDS`. Any other is refused, so a keyword that could
    carry packing or another meaning is never dropped unread."""
    from transformers.utils import TransformersKwargs

    return frozenset(TransformersKwargs.__annotations__) | MODEL_KEYWORDS


_KCP_STACK: list["kcp"] = []
"""The ``kcp`` blocks entered and not yet left, innermost last: the patched
ops read the innermost at each call (a module-level stack, as the patch
itself is module-level: one training loop per process)."""


class kcp:
    """``with kcp(ctx): ...``: the GDN / KDA layers that :class:`use_gdn_kcp`
    patched run under key-context parallelism within the block.

    Each rank calls the model together on its own rows of the packed stream
    ``ctx`` describes (``[1, T_r]`` tokens, ``ctx.rank_ranges[ctx.rank]``),
    with ``use_cache=False`` and no packing keywords (the context holds the
    packing); the backward, wherever it runs, exchanges what the forward
    did. A model's softmax-attention layers are not routed: see docs/api.md.

    Args:
        ctx: the :class:`~gdn_kcp.KcpContext` of this step's packing (exact or
            capped), built alike on every rank.
        options: the :class:`~gdn_kcp.OptionsKcp` of the layers' calls
            (default: ``OptionsKcp(save_mode=...)`` with the ``save_mode``
            given to :class:`use_gdn_kcp`); the q / k L2 norm is the layer's
            own switch, and KDA calls take ``gate="channel"`` themselves.

    Raises:
        TypeError: ``ctx`` or ``options`` of another type.
        RuntimeError: entered while no family is patched (the layers would
            run transformers' own ops on one rank's rows as if they were
            the whole stream).
    """

    def __init__(self, ctx: KcpContext, *, options: OptionsKcp | None = None) -> None:
        if not isinstance(ctx, KcpContext):
            raise TypeError(f"ctx must be a KcpContext, got {type(ctx).__name__}")
        if options is not None and not isinstance(options, OptionsKcp):
            raise TypeError(f"options must be an OptionsKcp or None, got {type(options).__name__}")
        self.ctx, self.options = ctx, options

    def __enter__(self) -> "kcp":
        if not any(is_patched(family) for family in installed_families()):
            raise RuntimeError("kcp(ctx) routes the layers use_gdn_kcp() patches, and no family is patched: "
                               "enter use_gdn_kcp() first")
        _KCP_STACK.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _KCP_STACK.remove(self)


def active_kcp() -> "kcp | None":
    """The innermost :class:`kcp` block entered, or None."""
    return _KCP_STACK[-1] if _KCP_STACK else None


@dataclass(frozen=True)
class _Call:
    """What one replacement op needs to know beyond its arguments."""

    family: str
    save_mode: str
    known: frozenset

    def bounds(self, op: str, cu_seqlens, kwargs: dict):
        """The packed batch's document bounds (``cu_seqlens``, else the
        ``cu_seq_lens_q`` a Kimi-family layer leaves in its keywords), after
        refusing any keyword transformers does not pass on."""
        unknown = sorted(set(kwargs) - self.known)
        if unknown:
            raise TypeError(f"transformers' {self.family} called {op} with keywords {unknown}, which gdn_kcp "
                            "does not know: the layer's call has changed")
        if cu_seqlens is None:
            cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is None and kwargs.get("seq_idx") is not None:
            raise ValueError(f"transformers' {self.family}: a batch packed by seq_idx reached {op}; pass the "
                             "document bounds as cu_seq_lens_q instead (gdn_kcp keeps documents apart by them)")
        return cu_seqlens

    def kcp_rows(self, op: str, block: kcp, rows: torch.Tensor, tokens: int, bounds) -> None:
        """Refuse, under ``block``, what a KCP call cannot take: packing
        keywords (the context holds the packing) and rows other than this
        rank's one row of ``T_r`` tokens (``tokens``: the call's token count;
        ``rows``: its batch size)."""
        ctx = block.ctx
        if bounds is not None:
            raise ValueError(f"transformers' {self.family}: under kcp(ctx) the context holds the packing, and "
                             f"{op} was also given cu_seq_lens_q: leave the packing keywords out")
        start, end = ctx.rank_ranges[ctx.rank]
        if rows != 1 or tokens != end - start:
            raise ValueError(f"transformers' {self.family}: under kcp(ctx) rank {ctx.rank} runs its range "
                             f"[{start}, {end}) of the packed stream as one row of {end - start} tokens, and {op} "
                             f"got {rows} row(s) of {tokens} (call the model on input_ids[:, {start}:{end}] with "
                             "use_cache=False: a cache prepends its states to the convolution's rows)")

    def kcp_options(self, block: kcp, use_qk_l2norm: bool) -> OptionsKcp:
        """``block``'s options with the layer's own q / k L2-norm switch."""
        options = block.options if block.options is not None else OptionsKcp(save_mode=self.save_mode)
        return dataclasses.replace(options, use_qk_l2norm=use_qk_l2norm)


def _no_cache_under_kcp(call: _Call, op: str, initial_state, output_final_state) -> None:
    """Decode caches run on one rank (as gdn_kcp's own layers': no cache with a KCP context)."""
    if initial_state is not None or output_final_state:
        raise ValueError(f"transformers' {call.family}: {op} under kcp(ctx) got a cache's state; caches run on one "
                         "rank: call the model with use_cache=False under kcp(ctx)")


def _state_for(initial_state, query):
    """transformers' cache holds fp32 states; the ops take fp32 states, and fp64
    ones for fp64 inputs (an fp32 state is widened exactly)."""
    if initial_state is not None and query.dtype == torch.float64 and initial_state.dtype == torch.float32:
        return initial_state.to(torch.float64)
    return initial_state


def _widened(g, query):
    """A gate computed in fp32 (the Kimi family's forget gate casts with
    ``.float()``) beside fp64 q, k, v: widened exactly, as the ops take one
    compute dtype for fp64 inputs."""
    return g.to(torch.float64) if query.dtype == torch.float64 and g.dtype == torch.float32 else g


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in tensors)


def _gdn_ops(call: _Call):
    def chunk(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        bounds = call.bounds("torch_chunk_gated_delta_rule", cu_seqlens, kwargs)
        block = active_kcp()
        if block is not None:
            call.kcp_rows("torch_chunk_gated_delta_rule", block, query.shape[0], query.shape[1], bounds)
            _no_cache_under_kcp(call, "torch_chunk_gated_delta_rule", initial_state, output_final_state)
            return gdn_kcp(query, key, value, g, beta, block.ctx, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                           options=call.kcp_options(block, use_qk_l2norm_in_kernel))
        return chunk_gated_delta_rule(query, key, value, g, beta, initial_state=_state_for(initial_state, query),
                                      output_final_state=output_final_state,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=bounds,
                                      chunk_size=chunk_size, save_mode=call.save_mode)

    def recurrent(query, key, value, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        bounds = call.bounds("torch_recurrent_gated_delta_rule", cu_seqlens, kwargs)
        if active_kcp() is not None:  # the layers take this op for cached steps only
            _no_cache_under_kcp(call, "torch_recurrent_gated_delta_rule", initial_state, True)
        state = _state_for(initial_state, query)
        if _needs_grad(query, key, value, g, beta, state):
            # The token-by-token op is forward only (as FLA's); a step that trains takes the chunked
            # op, the same recurrence with a backward.
            return chunk_gated_delta_rule(query, key, value, g, beta, initial_state=state,
                                          output_final_state=output_final_state,
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=bounds,
                                          save_mode=call.save_mode)
        return fused_recurrent_gated_delta_rule(query, key, value, g, beta=beta, initial_state=state,
                                                output_final_state=output_final_state,
                                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                                cu_seqlens=bounds)

    return chunk, recurrent


def _kda_ops(call: _Call):
    def chunk(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
        bounds = call.bounds("chunk_kimi_delta_attention", None, kwargs)
        block = active_kcp()
        if block is not None:
            call.kcp_rows("chunk_kimi_delta_attention", block, query.shape[0], query.shape[1], bounds)
            _no_cache_under_kcp(call, "chunk_kimi_delta_attention", initial_state, output_final_state)
            return kda_kcp(query, key, value, _widened(g, query), beta, block.ctx,
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                           options=call.kcp_options(block, use_qk_l2norm_in_kernel))
        return chunk_kda(query, key, value, _widened(g, query), beta, initial_state=_state_for(initial_state, query),
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         cu_seqlens=bounds, chunk_size=chunk_size, save_mode=call.save_mode)

    def recurrent(query, key, value, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **kwargs):
        bounds = call.bounds("recurrent_kimi_delta_attention", None, kwargs)
        if active_kcp() is not None:
            _no_cache_under_kcp(call, "recurrent_kimi_delta_attention", initial_state, True)
        g, state = _widened(g, query), _state_for(initial_state, query)
        if _needs_grad(query, key, value, g, beta, state):
            return chunk_kda(query, key, value, g, beta, initial_state=state, output_final_state=output_final_state,
                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=bounds,
                             save_mode=call.save_mode)
        return fused_recurrent_kda(query, key, value, g, beta, initial_state=state,
                                   output_final_state=output_final_state,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=bounds)

    return chunk, recurrent


def _conv_op(call: _Call, original: Callable):
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        """transformers' prefill convolution: ``hidden_states`` ``[B, D, T]``,
        ``weight`` ``[D, W]``; computed in the weight's dtype, returned in the
        input's (as transformers' own)."""
        bounds = call.bounds(CONV_NAME, None, kwargs)
        block = active_kcp()
        if activation not in SILU:
            if block is not None:
                raise ValueError(f"transformers' {call.family}: under kcp(ctx) the short convolution reads the "
                                 "previous rank's rows, which gdn_kcp's short_conv does with SiLU only; this "
                                 f"layer's activation is {activation!r}")
            if bounds is not None:
                raise ValueError(f"transformers' {call.family}: a packed batch needs its short convolution "
                                 "restarted at each document, which gdn_kcp's short_conv does with SiLU only; "
                                 f"this layer's activation is {activation!r}")
            return original(hidden_states, weight, bias, activation=activation)
        if block is not None:
            call.kcp_rows(CONV_NAME, block, hidden_states.shape[0], hidden_states.shape[-1], bounds)
            x = hidden_states.transpose(1, 2).to(weight.dtype)
            return short_conv_kcp(x, weight, bias, block.ctx).transpose(1, 2).to(hidden_states.dtype)
        doc_starts = None
        if bounds is not None:
            T = hidden_states.shape[-1]
            if not values_readable(bounds):  # traced: a host read would break the graph; checked on the device
                torch._assert_async(bounds[-1] == T, f"transformers' {call.family}: cu_seq_lens_q must end at the "
                                    f"{T} tokens the convolution sees")
            elif int(bounds[-1]) != T:
                raise ValueError(f"transformers' {call.family}: cu_seq_lens_q ends at {int(bounds[-1])} but the "
                                 f"convolution sees {T} tokens (a packed batch continuing a cache is not supported)")
            doc_starts = bounds[:-1]
        x = hidden_states.transpose(1, 2).to(weight.dtype)
        return short_conv(x, weight, bias, doc_starts).transpose(1, 2).to(hidden_states.dtype)

    return causal_conv1d_fn


class use_gdn_kcp:
    """Route transformers' GDN and KDA families to gdn_kcp's ops.

    Called, it patches and returns a handle (``.restore()`` undoes it); as a
    context manager it undoes the patch on exit. Nested uses restore in order.

    Args:
        families: the families to patch (default: every one of :data:`FAMILIES`
            the installed transformers ships); a family it lacks is a
            ``ValueError``.
        save_mode: ``OptionsKcp.save_mode`` of the chunked calls: ``"light"``
            (the default) keeps nothing for the backward beyond the inputs and
            recomputes; ``"full"`` keeps every tape (on a CPU, where memory is
            rarely short and the recompute is most of the light mode's extra
            time, ``"full"`` is the faster).

    Raises:
        ImportError: transformers is not installed.
        RuntimeError: the installed transformers is outside
            :data:`SUPPORTED_VERSIONS`, or a family's ops are not the calls
            this module was written against.
    """

    def __init__(self, families: tuple[str, ...] | list[str] | None = None, *, save_mode: str = "light") -> None:
        version = transformers_version()
        check_version(version)
        OptionsKcp(save_mode=save_mode)  # the ValueError naming a bad save_mode, before anything is patched
        present = installed_families()
        if families is None:
            chosen = list(present)
        else:
            if isinstance(families, str) or not isinstance(families, (tuple, list)):
                raise TypeError(f"families must be a tuple or list of family names, got {families!r}")
            chosen = list(families)
            for family in chosen:
                if family not in present:
                    raise ValueError(f"families: {family!r} is not a GDN or KDA family of transformers {version} "
                                     f"(those present: {sorted(present)})")
        known = transformers_keywords()
        modules = {family: modeling_module(family) for family in chosen}
        for family, module in modules.items():  # check all before patching any
            check_family(family, module)
        self.families = tuple(chosen)
        self._saved: list[tuple[object, str, object]] = []
        for family, module in modules.items():
            call = _Call(family, save_mode, known)
            kind = FAMILIES[family]
            chunk, recurrent = (_gdn_ops if kind == GDN else _kda_ops)(call)
            conv = _conv_op(call, getattr(module, CONV_NAME))
            for name, replacement in zip((*OP_NAMES[kind], CONV_NAME), (chunk, recurrent, conv)):
                replacement.gdn_kcp_family = family
                replacement.__name__ = replacement.__qualname__ = name
                self._saved.append((module, name, getattr(module, name)))
                setattr(module, name, replacement)

    def restore(self) -> None:
        """Put back the ops this handle replaced (a second call does nothing)."""
        while self._saved:
            module, name, previous = self._saved.pop()
            setattr(module, name, previous)

    def __enter__(self) -> "use_gdn_kcp":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def is_patched(family: str) -> bool:
    """Whether ``family``'s chunked op is gdn_kcp's now."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    op = getattr(modeling_module(family), OP_NAMES[FAMILIES[family]][0])
    return getattr(op, "gdn_kcp_family", None) == family
