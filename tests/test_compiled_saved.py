"""A compiled step keeps what the save mode says, to the byte, on the opaque
ops and on the traced host path (:func:`gdn_kcp.trace_host_path`).

Each case compiles a model around one GDN call (projections before it, an
output projection and an MLP after it) through Inductor's own pipeline up to
its code generation (tests/compiled_saved_cases.py) and reads what the
forward graph hands the backward graph: GDN's saved set equals
``gdn_saved_bytes_kcp`` exactly, every other kept tensor is the same on both
paths, and the traced backward runs the eager backward's programs and no other.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from checkpoint_cases import BOUNDS
from compiled_saved_cases import Step, check_step, index_tables, one_rank, run_ranks, saved_query
from doc_tables import table_rows
from gdn_kcp import OptionsKcp
from gdn_kcp.context.builders import capped_context
from gdn_kcp.context.sms import device_sms
from spawn import spawn_ranks

SAVE_MODES = ("light", "inverse", "full")


def fla_context():
    """The context ``chunk_gated_delta_rule`` builds for ``cu_seqlens=BOUNDS``."""
    return capped_context(torch.tensor(BOUNDS), [(0, BOUNDS[-1])], 0, n_sms=device_sms("cpu"))


@pytest.mark.parametrize("form", ["none", "policy"])
@pytest.mark.parametrize("save_mode", SAVE_MODES)
def test_one_rank_keeps_the_saved_layout(save_mode, form):
    """One rank, the FLA-style entry: without checkpoint and in a region
    checkpointed with ``checkpoint_policy()``. The index tables the call
    builds from ``cu_seqlens`` are kept besides the saved layout (their bytes
    are named in docs/bytes.md, not counted by the query); in the
    checkpointed region they are rebuilt. The figures are docs/compile.md's
    table's row. Checkpointed, the traced backward replays what the save mode
    says: light prep and the tape walk, inverse the tape walk and W, U, full
    neither; none runs the output (with ``checkpoint_policy()``, o is kept)."""
    options, ctx = OptionsKcp(save_mode=save_mode, use_qk_l2norm=True), fla_context()
    tables = index_tables(ctx) if form == "none" else Counter()  # the checkpoint rebuilds them from cu_seqlens
    found = check_step(Step(one_rank(save_mode), form), saved_query(ctx, options), f"{save_mode}, {form}", tables)
    row = [r for r in table_rows("compiled-saved") if r[:2] == [save_mode, form]]
    assert row == [[save_mode, form, *(f"{found[key]:,}" for key in ("query", "gdn_opaque", "gdn_traced"))]], row
    if form == "policy":
        backward = found["traced_backward"]
        assert not backward & {"walk_output", "output", "scores"}, backward
        assert ("prep" in backward) == (save_mode == "light"), backward
        assert ("tape_walk" in backward) == (save_mode != "full"), backward


@pytest.mark.parametrize("exchange", ["a2a", pytest.param("ring", marks=pytest.mark.extended)])
def test_two_ranks_keep_the_saved_layout(exchange):
    """Two gloo ranks, ``gdn_kcp`` on each rank's slice, each rank's graphs."""
    spawn_ranks(2, run_ranks, [dict(save_mode=mode, exchange=exchange) for mode in SAVE_MODES], "none")


THREE_RANK_OPTIONS = {
    "ci": [dict(save_transfer=True, segments=2)],
    "extended": [dict(boundary_mode="replay"), dict(save_mode="inverse", segments=2),
                 dict(save_for_backward=False, boundary_mode="replay")],
}


@pytest.mark.parametrize("options", ["ci", pytest.param("extended", marks=pytest.mark.extended)])
def test_three_ranks_keep_the_saved_layout_with_every_option(options):
    """A middle rank; the owners' M kept and two segments a fragment; in make
    test-extended a replayed boundary alone, inverse mode with two segments,
    and no saved set (the backward replays the forward)."""
    spawn_ranks(3, run_ranks, THREE_RANK_OPTIONS[options], "none")


@pytest.mark.parametrize("save_mode", ["light", pytest.param("inverse", marks=pytest.mark.extended)])
def test_two_ranks_keep_the_saved_layout_under_a_checkpoint(save_mode):
    spawn_ranks(2, run_ranks, [dict(save_mode=save_mode)], "policy")
