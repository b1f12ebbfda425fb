"""``gdn_kcp::all_to_all``: the traced host path's exchange, an ordered effect.

Under torch.compile with R > 1 every rank traces its own graph (its fragments
decide what it sends and uses), and the graph passes place a node by what
depends on it. Tried with functional collectives (``_c10d_functional``), that
broke the group: AOT autograd dropped, on the rank nothing crosses into, the
forward's c2 whose result it does not use, and moved its b1, whose send does
not depend on the backward's inputs, into the forward. An order token chained
through the collectives fixed that under aot_eager; under Inductor the ranks'
exchanges still stopped matching (cause not pinned down). Each time the group
hung. An op registered as an ordered effect is never dropped, merged,
recomputed or moved across the forward / backward split, and keeps its order
among the call's effects: the same exchanges, in the same order, in the same
graph, on every rank. The price: Inductor runs it as an extern call that
returns when the data has arrived, so it cannot sink the wait below other work
(``schedule="overlap"`` is not built).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from gdn_kcp.context.from_meta import group_from_name


@torch.library.custom_op("gdn_kcp::all_to_all", mutates_args=())
def ordered_all_to_all(send: Tensor, sends: list[int], recvs: list[int], group_name: str) -> Tensor:
    """``send`` (1-D) split by ``sends`` to the ranks of ``group_name`` (empty:
    the default group, as a context built without a group); returns what
    arrives, 1-D, split by ``recvs``."""
    received = send.new_empty(sum(recvs))
    dist.all_to_all_single(received, send, output_split_sizes=recvs, input_split_sizes=sends,
                           group=group_from_name(group_name) if group_name else None)
    return received


@ordered_all_to_all.register_fake
def _(send: Tensor, sends: list[int], recvs: list[int], group_name: str) -> Tensor:
    return send.new_empty(sum(recvs))


def _register_ordered() -> bool:
    """Register the op as an ordered effect: ``CustomOpDef.register_effect``
    (torch 2.13), else the older private registry; False when neither exists
    (then KCP keeps the opaque ops under :func:`gdn_kcp.trace_host_path`)."""
    try:
        from torch._library.effects import EffectType

        ordered_all_to_all.register_effect(EffectType.ORDERED)
        return True
    except (ImportError, AttributeError):
        pass
    try:
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

        _register_effectful_op(torch.ops.gdn_kcp.all_to_all.default, _EffectType.ORDERED)
        return True
    except (ImportError, AttributeError):
        return False


ORDERED = _register_ordered()
"""Whether the exchange is an ordered effect in this torch (KCP traces only then)."""
