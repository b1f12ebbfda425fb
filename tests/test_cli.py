"""``python -m gdn_kcp``: every bad argument is refused by argparse (exit 2, a
message naming the argument) before anything is printed or spawned; the KCP
demo's packing works for every token count it accepts."""

from __future__ import annotations

import pytest

from gdn_kcp.__main__ import main
from gdn_kcp.context import default_ranges
from gdn_kcp.demo_kcp import packed_bounds

REFUSED = [
    ("budget --ranks 0", "argument --ranks: must be a positive integer, got 0"),
    ("budget --max-docs 0", "argument --max-docs: must be a positive integer, got 0"),
    ("budget --n-docs 9 --max-docs 8", "argument --max-docs: the packing holds 9 documents, more than max_docs = 8"),
    ("budget --ranks -1", "argument --ranks: must be a positive integer, got -1"),
    ("budget --ranks two", "argument --ranks: must be an integer, got 'two'"),
    ("budget --tokens -5", "argument --tokens: must be a positive integer, got -5"),
    ("budget --tokens 0", "argument --tokens: must be a positive integer, got 0"),
    ("budget --n-docs 0", "argument --n-docs: must be a positive integer, got 0"),
    ("budget --hq 0", "argument --hq: must be a positive integer, got 0"),
    ("budget --k -128", "argument --k: must be a positive integer, got -128"),
    ("budget --docs 10,-2", "argument --docs: lengths must not be negative, got -2"),
    ("budget --docs 10,x", "argument --docs: must be comma-separated integers"),
    ("budget --docs 0,0", "argument --docs: the documents hold no token"),
    ("budget --docs 10,20 --tokens 31", "argument --docs: the lengths add up to 30 tokens, --tokens says 31"),
    ("budget --docs 10 --ranks 3 --rank-tokens 5,5", "argument --rank-tokens: lists 2 ranks, --ranks says 3"),
    ("budget --docs 10 --ranks 2 --rank-tokens 5,6", "argument --rank-tokens: adds up to 11 tokens"),
    ("budget --hq 3 --hv 8", "argument --hv: HV = 8 must be a multiple of --hq = 3"),
    ("budget --save-mode full --no-save-for-backward", "save_mode='full'"),
    ("demo --ranks 0", "argument --ranks: must be an integer from 1 to 64, got 0"),
    ("demo --ranks -1", "argument --ranks: must be an integer from 1 to 64, got -1"),
    ("demo --ranks 65", "argument --ranks: must be an integer from 1 to 64, got 65"),
    ("demo --kcp-tokens 0", "argument --kcp-tokens: must be a positive integer, got 0"),
    ("demo --ranks 4 --kcp-tokens 3", "argument --kcp-tokens: must be at least --ranks = 4"),
    ("demo --steps -1", "argument --steps: must be a non-negative integer, got -1"),
    ("demo --tokens 0", "argument --tokens: must be a positive integer, got 0"),
]


@pytest.mark.parametrize("argv, message", REFUSED, ids=[argv for argv, _ in REFUSED])
def test_bad_arguments_exit_2_before_any_output(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv.split())
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"python -m gdn_kcp {argv.split()[0]}: error: {message}" in err


def test_budget_prints_every_rank(capsys):
    main("budget --docs 300,0,700 --ranks 3 --rank-tokens 500,0,500 --hq 2 --hv 4 --k 64 --v 64".split())
    out = capsys.readouterr().out
    assert out.startswith("budget: T = 1000 tokens in 3 documents over R = 3 ranks")
    assert "rank 1: tokens [500, 500)" in out and "rank 2: tokens [500, 1000)" in out
    # rank 0 starts both non-empty documents (and the empty one at 300), rank 2 ends the crossing one
    assert out.count("initial_state ") == 3 and "initial_state [3, 4, 64, 64]" in out
    assert "final_state   [1, 4, 64, 64]" in out


@pytest.mark.parametrize("R", [1, 2, 3, 4, 5, 8])
def test_demo_packing_crosses_every_rank_at_any_size(R):
    """For every T >= R: valid bounds, and one document from rank 0 to the last rank."""
    for T in [*range(R, 300), 4096, 4099]:
        bounds = packed_bounds(T, R)
        assert bounds[0] == 0 and bounds[-1] == T, (T, R, bounds)
        assert all(a <= b for a, b in zip(bounds, bounds[1:])), (T, R, bounds)
        ranges = default_ranges(T, R)
        assert any(a < ranges[0][1] and b > ranges[-1][0] for a, b in zip(bounds, bounds[1:])), (T, R, bounds)


def test_demo_packing_of_the_default_run_is_unchanged():
    assert packed_bounds(4096, 4)[:7] == [0, 37, 37, 127, 512, 3584, 3757]
