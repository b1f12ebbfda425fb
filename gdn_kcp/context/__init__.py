"""KcpContext and its builders: how one packed stream is split over the ranks
of a process group.

    kcp_context.py  KcpContext, this rank's view (group, ranges, crossing
                    flags, chains, the chunk index); pure data and properties
    build.py        build_kcp_context, the public entry (one small collective
                    checks that every rank was given the same split)
    builders.py     context_from_split (exact, from host bounds) and
                    capped_context (traceable, no host read): no collective
    split.py        rank ranges, each rank's fragments, the chains
    from_meta.py    context_from_meta: the context an op rebuilds from its ints
    sms.py          the SM count the segment plan fills

Every name is re-exported here, so ``from gdn_kcp.context import X`` works for
all of them.
"""

from gdn_kcp.context.build import build_kcp_context, check_same_everywhere
from gdn_kcp.context.builders import capped_context, context_from_split
from gdn_kcp.context.from_meta import context_from_meta, group_from_name
from gdn_kcp.context.kcp_context import KcpContext
from gdn_kcp.context.sms import check_sms, device_sms
from gdn_kcp.context.split import check_ranges, default_ranges, rank_fragments

__all__ = [
    "KcpContext",
    "build_kcp_context",
    "capped_context",
    "check_ranges",
    "check_same_everywhere",
    "check_sms",
    "context_from_meta",
    "context_from_split",
    "default_ranges",
    "device_sms",
    "group_from_name",
    "rank_fragments",
]
