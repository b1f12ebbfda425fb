"""Every row of the byte-query tables of docs/bytes.md (and the cost-of-caps
table of docs/compile.md) agrees with the queries: the formula evaluated at the
example, the figure printed, and the query's bytes. (The file keeps its name:
make mutate runs it by name.)"""

from __future__ import annotations

import pytest
from arena_cases import valid_options
from doc_tables import (
    EXAMPLE_DTYPE,
    EXAMPLE_SHAPES,
    evaluate,
    example_context,
    example_label,
    figure,
    options_of,
    paragraph_before,
    table_rows,
)

from gdn_kcp import OptionsKcp
from gdn_kcp.queries.layout import gdn_saved_layout_kcp, gdn_workspace_layout_kcp


def layout(options):
    return gdn_workspace_layout_kcp(example_context(), **EXAMPLE_SHAPES, dtype=EXAMPLE_DTYPE, options=options)


def saved(options):
    return gdn_saved_layout_kcp(example_context(), **EXAMPLE_SHAPES, dtype=EXAMPLE_DTYPE, options=options)


POOL_ROWS = table_rows("workspace-pools")
SAVED_ROWS = table_rows("saved-tensors")
CALL_ROWS = table_rows("call-figures")


def test_tables_are_found_and_rows_unique():
    assert len(POOL_ROWS) >= 25 and len(SAVED_ROWS) >= 10 and len(CALL_ROWS) >= 4
    for rows in (POOL_ROWS, SAVED_ROWS):
        keys = [(row[0], row[2] if rows is POOL_ROWS else row[1]) for row in rows]
        assert len(keys) == len(set(keys)), keys


@pytest.mark.parametrize("row", POOL_ROWS, ids=lambda row: f"{row[0]}[{row[2]}]")
def test_pool_row(row):
    name, calls, when, formula, printed = row[:5]
    options = options_of(when)
    ours = layout(options)
    assert evaluate(formula, options) == figure(printed) == ours.pool_bytes[name]
    assert {c.strip() for c in calls.split(",")} == {c.call for c in (ours.fwd, ours.bwd) if name in c.pools}


@pytest.mark.parametrize("row", SAVED_ROWS, ids=lambda row: f"{row[0]}[{row[1]}]")
def test_saved_row(row):
    name, when, formula, printed = row[:4]
    options = options_of(when)
    assert evaluate(formula, options) == figure(printed) == saved(options)[name].nbytes


@pytest.mark.parametrize("row", CALL_ROWS, ids=lambda row: row[0])
def test_call_row(row):
    ours = layout(options_of(row[0]))
    assert [figure(x) for x in row[1:4]] == [ours.fwd.bytes, ours.bwd.bytes, ours.bytes]


def test_kda_rows_are_the_kda_queries():
    """The ``gate="channel"`` rows are KDA calls: ``kda_workspace_layout_kcp`` at
    the example gives their figures (its backward binds ``dgcum`` K times GDN's)."""
    from gdn_kcp import kda_workspace_layout_kcp

    kda = kda_workspace_layout_kcp(example_context(), **EXAMPLE_SHAPES, dtype=EXAMPLE_DTYPE)
    rows = [row for row in CALL_ROWS if options_of(row[0]).gate == "channel"]
    assert len(rows) == 1 and [figure(x) for x in rows[0][1:4]] == [kda.fwd.bytes, kda.bwd.bytes, kda.bytes]
    pool = [row for row in POOL_ROWS if row[0] == "dgcum" and options_of(row[2]).gate == "channel"]
    assert len(pool) == 1 and figure(pool[0][4]) == kda.pool_bytes["dgcum"]
    assert kda.pool_bytes["dgcum"] == EXAMPLE_SHAPES["K"] * layout(OptionsKcp()).pool_bytes["dgcum"]


def test_call_figures_label_states_what_test_call_row_computes():
    """The label names the example and the defaults test_call_row evaluates at
    (OptionsKcp defaults for every option a row does not name)."""
    label = paragraph_before("call-figures")
    assert example_label() in label, label
    assert "with every option a row does not name at its default" in label, label
    assert "`use_qk_l2norm=False` outside its own row" in label and not OptionsKcp().use_qk_l2norm, label
    assert OptionsKcp(use_qk_l2norm=True) in [options_of(row[0]) for row in CALL_ROWS]


def test_every_pool_and_saved_tensor_has_a_row():
    pool_names = {row[0] for row in POOL_ROWS}
    saved_names = {row[0] for row in SAVED_ROWS}
    for options in valid_options():
        ours = layout(options)
        assert set(ours.fwd.pools) | set(ours.bwd.pools) <= pool_names, options
        assert set(saved(options)) <= saved_names, options


def test_caps_cost_table():
    """The cost-of-caps table is what the byte queries give today."""
    from doc_tables import caps_cost_rows

    assert table_rows("caps-cost")[1:] == caps_cost_rows()  # below the header row
