"""OptionsKcp: every option of a KCP call, in one frozen dataclass (DESIGN.md §4)."""

from __future__ import annotations

from dataclasses import dataclass

EXCHANGES = ("a2a", "ring")


@dataclass(frozen=True)
class OptionsKcp:
    """Options of :func:`gdn_kcp.gdn_kcp` and of the byte queries.

    exchange: ``"a2a"`` (default) sends each owner its head slice of the
        summaries and gets the start states back: per rank one summary out and
        one state in, whatever R; ``"ring"`` passes the boundary state from rank
        to rank along each crossing document (no M on the wire, but the ranks of
        a long document wait on one another).

    use_qk_l2norm: L2-normalise q and k per token and head inside the kernels.

    Example: ``gdn_kcp(q, k, v, g, beta, ctx, options=OptionsKcp(exchange="ring"))``.
    """

    exchange: str = "a2a"
    use_qk_l2norm: bool = False

    def __post_init__(self) -> None:
        if self.exchange not in EXCHANGES:
            raise ValueError(f"OptionsKcp.exchange must be one of {EXCHANGES}, got {self.exchange!r}")
        if not isinstance(self.use_qk_l2norm, bool):
            raise ValueError(f"OptionsKcp.use_qk_l2norm must be a bool, got {self.use_qk_l2norm!r}")
