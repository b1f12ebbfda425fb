"""The byte queries of KDA calls (:func:`gdn_kcp.chunk_kda`, :func:`gdn_kcp.kda_kcp`).

A KDA call runs GDN's host path with a gate per key channel
(``OptionsKcp.gate="channel"``), so each ``kda_*`` query is its ``gdn_*``
query on those options: the same arguments, the same truth. What differs is
the backward's gate-cumsum gradient ``dgcum`` (``[T, HV, K]`` against
``[T, HV]``, compute dtype) and its per-value-head ``dq_heads`` and
``dk_heads``, in the compute dtype where GDN's are in the input dtype
(``gdn_kcp.dtypes.CHANNEL_COMPUTE_BUFFERS``); the summaries, states, tapes and
traffic have GDN's shapes (``M`` is K x K either way, docs/design.md).

    kda_workspace_bytes_kcp(ctx, 16, 32, 128, 128, dtype=torch.bfloat16)
"""

from __future__ import annotations

import functools
from dataclasses import replace

from gdn_kcp.options import OptionsKcp

from . import comm, layout


def _for_kda(query):
    """``query`` with ``options.gate`` set to ``"channel"`` (the options given, or the defaults)."""

    @functools.wraps(query)
    def kda_query(*args, **kwargs):
        options = kwargs.pop("options", None) or OptionsKcp()
        if not isinstance(options, OptionsKcp):
            raise TypeError(f"options must be an OptionsKcp or None, got {type(options).__name__}")
        return query(*args, options=replace(options, gate="channel"), **kwargs)

    kda_query.__name__ = kda_query.__qualname__ = query.__name__.replace("gdn_", "kda_", 1)
    kda_query.__doc__ = (f":func:`gdn_kcp.{query.__name__}` of a KDA call (``options.gate=\"channel\"``; "
                         f"module :mod:`gdn_kcp.queries.kda`).")
    return kda_query


kda_workspace_layout_kcp = _for_kda(layout.gdn_workspace_layout_kcp)
kda_workspace_bytes_kcp = _for_kda(layout.gdn_workspace_bytes_kcp)
kda_saved_layout_kcp = _for_kda(layout.gdn_saved_layout_kcp)
kda_saved_bytes_kcp = _for_kda(layout.gdn_saved_bytes_kcp)
kda_checkpoint_bytes_kcp = _for_kda(layout.gdn_checkpoint_bytes_kcp)
kda_comm_bytes_kcp = _for_kda(comm.gdn_comm_bytes_kcp)
kda_det_workspace_layout_kcp = _for_kda(layout.gdn_det_workspace_layout_kcp)
kda_det_workspace_bytes_kcp = _for_kda(layout.gdn_det_workspace_bytes_kcp)
kda_det_saved_layout_kcp = _for_kda(layout.gdn_det_saved_layout_kcp)
kda_det_saved_bytes_kcp = _for_kda(layout.gdn_det_saved_bytes_kcp)
kda_det_comm_bytes_kcp = _for_kda(comm.gdn_det_comm_bytes_kcp)
kda_state_layout_kcp = layout.gdn_state_layout_kcp
"""The states of a KDA call are GDN's (``[N, HV, K, V]``, compute dtype): the same query."""
kda_intermediate_states_layout_kcp = layout.gdn_intermediate_states_layout_kcp
"""A KDA call's states at chunk starts are GDN's (``[NC, HV, K, V]``, input dtype): the same query."""

KDA_QUERIES = (
    "kda_checkpoint_bytes_kcp", "kda_comm_bytes_kcp", "kda_det_comm_bytes_kcp", "kda_det_saved_bytes_kcp",
    "kda_det_saved_layout_kcp", "kda_det_workspace_bytes_kcp", "kda_det_workspace_layout_kcp",
    "kda_intermediate_states_layout_kcp",
    "kda_saved_bytes_kcp", "kda_saved_layout_kcp", "kda_state_layout_kcp", "kda_workspace_bytes_kcp",
    "kda_workspace_layout_kcp",
)
