"""``python -m gdn_kcp demo``: three parts, run in this order by
:mod:`gdn_kcp.__main__`.

    kcp.py      KCP of one packed stream over R gloo processes, every rank's
                rows and gradients against the one-rank run
    layer.py    a small GDN layer trained on one rank, then checked against
                the fp64 oracle
    byte_lm.py  a byte-level language model of two GatedDeltaNet layers
                trained with KCP over R processes

The demo needs only torch (no numpy): a fresh ``make demo`` venv has nothing else.
"""

from gdn_kcp.demo.byte_lm import run_lm_demo
from gdn_kcp.demo.kcp import packed_bounds, run_kcp_demo
from gdn_kcp.demo.layer import run_demo

__all__ = ["packed_bounds", "run_demo", "run_kcp_demo", "run_lm_demo"]
