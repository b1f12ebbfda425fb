"""``python -m gdn_kcp budget``: the summary and the detail are pinned outputs
(``EXPECTTEST_ACCEPT=1`` rewrites them, docs/testing.md); the JSON carries the
same figures as the byte queries; ``--layers N`` is N x saved + one workspace
per rank; ``--with-conv`` / ``--conv-size`` add the layer's halo; the example
printed in docs/bytes.md is the command's output."""

from __future__ import annotations

import json
import re

import expecttest
import torch
from doc_tables import doc
from test_cli import run_cli

from gdn_kcp import OptionsKcp
from gdn_kcp.context import context_from_split
from gdn_kcp.queries import gdn_comm_bytes_kcp, gdn_saved_bytes_kcp, gdn_workspace_bytes_kcp, gdn_workspace_layout_kcp

SMALL = "budget --docs 300,0,700 --ranks 3 --rank-tokens 500,0,500 --hq 2 --hv 4 --k 64 --v 64"
"""Three documents (one empty) over three ranks, the middle one empty: rank 0
starts the crossing document, rank 2 ends it."""


def budget(argv: str) -> str:
    code, out, err = run_cli(argv)
    assert (code, err) == (0, ""), err
    return out


def budget_json(argv: str) -> dict:
    return json.loads(budget(argv + " --json"))


class PinnedPrintouts(expecttest.TestCase):
    def test_summary(self):
        self.assertExpectedInline(budget(SMALL + " --layers 4"), """\
budget: T = 1000 tokens in 3 documents over R = 3 ranks; H_qk = 2, HV = 4, K = 64, V = 64, bf16 inputs
  OptionsKcp(deterministic=False, save_mode='light', boundary_mode='saved', save_transfer=False, save_for_backward=True, graph='off', exchange='a2a', schedule='serial', segments=None, use_qk_l2norm=False, with_conv=False, conv_size=4, reuse_recompute_tapes=None, recompute_output='auto', gate='head')
  segments: the plan's P = 1 on 132 SMs (longest fragment 8 chunks, at most 3 fragments per rank; gdn_kcp.plan), taken

bytes per rank for one layer (saved: kept from its forward to its backward; states: initial + final; comm: one forward and backward)
rank  tokens       workspace  saved per layer   states  comm sent  comm recv  model, N = 4
   0  [0, 500)     2,134,016                0  327,680    163,840    163,840     2,134,016
   1  [500, 500)      65,536                0        0     65,536     65,536        65,536
   2  [500, 1000)  2,068,480           98,304   65,536    163,840    163,840     2,461,696
 max               2,134,016           98,304  327,680    163,840    163,840     2,461,696

model of 4 layers (--layers), per rank: N x saved per layer + one workspace; at most 2,461,696 B (2.35 MiB), on rank 2
traffic of 4 layers per training step, per rank: N x comm sent; at most 655,360 B (0.62 MiB), on rank 0
""")

    def test_summary_with_the_layers_convolution(self):
        self.assertExpectedInline(budget(SMALL + " --layers 4 --with-conv --conv-size 3"), """\
budget: T = 1000 tokens in 3 documents over R = 3 ranks; H_qk = 2, HV = 4, K = 64, V = 64, bf16 inputs
  OptionsKcp(deterministic=False, save_mode='light', boundary_mode='saved', save_transfer=False, save_for_backward=True, graph='off', exchange='a2a', schedule='serial', segments=None, use_qk_l2norm=False, with_conv=True, conv_size=3, reuse_recompute_tapes=None, recompute_output='auto', gate='head')
  segments: the plan's P = 1 on 132 SMs (longest fragment 8 chunks, at most 3 fragments per rank; gdn_kcp.plan), taken

bytes per rank for one layer (saved: kept from its forward to its backward; states: initial + final; comm: one forward and backward)
rank  tokens       workspace  saved per layer   states  comm sent  comm recv  model, N = 4
   0  [0, 500)     2,134,016            2,048  327,680    167,936    167,936     2,142,208
   1  [500, 500)      65,536            2,048        0     73,728     73,728        73,728
   2  [500, 1000)  2,068,480          100,352   65,536    167,936    167,936     2,469,888
 max               2,134,016          100,352  327,680    167,936    167,936     2,469,888

model of 4 layers (--layers), per rank: N x saved per layer + one workspace; at most 2,469,888 B (2.36 MiB), on rank 2
traffic of 4 layers per training step, per rank: N x comm sent; at most 671,744 B (0.64 MiB), on rank 0
""")

    def test_detail(self):
        self.assertExpectedInline(budget("budget --docs 100,60 --ranks 2 --hq 1 --hv 2 --k 16 --v 16 --segments 2 --detail"), """\
budget: T = 160 tokens in 2 documents over R = 2 ranks; H_qk = 1, HV = 2, K = 16, V = 16, bf16 inputs
  OptionsKcp(deterministic=False, save_mode='light', boundary_mode='saved', save_transfer=False, save_for_backward=True, graph='off', exchange='a2a', schedule='serial', segments=2, use_qk_l2norm=False, with_conv=False, conv_size=4, reuse_recompute_tapes=None, recompute_output='auto', gate='head')
  segments: the plan's P = 1 on 132 SMs (longest fragment 2 chunks, at most 2 fragments per rank; gdn_kcp.plan), --segments 2 given

bytes per rank for one layer (saved: kept from its forward to its backward; states: initial + final; comm: one forward and backward)
rank  tokens     workspace  saved per layer  states  comm sent  comm recv  model, N = 1
   0  [0, 80)       56,576                0   2,048      4,096      4,096        56,576
   1  [80, 160)     50,944            2,048   6,144      4,096      4,096        52,992
 max                56,576            2,048   6,144      4,096      4,096        56,576

model of 1 layer (--layers), per rank: N x saved per layer + one workspace; at most 56,576 B (0.05 MiB), on rank 0
traffic of 1 layer per training step, per rank: N x comm sent; at most 4,096 B (0.00 MiB), on rank 0

rank 0: tokens [0, 80), 1 fragments, 2 chunks, n_in=0 n_out=1 middle=0
  segments P = 2: 2 summary rows
  workspace (gdn_workspace_bytes_kcp)          56,576 B       0.05 MiB
    fwd.phase.prep                     30,720 B       0.03 MiB
    fwd.phase.segments                 18,688 B       0.02 MiB
    fwd.phase.summary                  20,736 B       0.02 MiB
    fwd.phase.c1                       22,784 B       0.02 MiB
    fwd.phase.c2                       20,736 B       0.02 MiB
    fwd.phase.compose                  22,784 B       0.02 MiB
    fwd.phase.walk                     35,072 B       0.03 MiB  <- largest
    fwd.phase.output                   25,600 B       0.02 MiB
    bwd.phase.prep                     30,720 B       0.03 MiB
    bwd.phase.segments                 39,168 B       0.04 MiB
    bwd.phase.compose                  43,264 B       0.04 MiB
    bwd.phase.walk                     45,312 B       0.04 MiB
    bwd.phase.local_dv                 46,336 B       0.04 MiB
    bwd.phase.segment_nu               50,432 B       0.05 MiB
    bwd.phase.nu                       50,432 B       0.05 MiB
    bwd.phase.b1                       51,456 B       0.05 MiB
    bwd.phase.b2                       53,504 B       0.05 MiB
    bwd.phase.compose_adjoint          56,576 B       0.05 MiB  <- largest
    bwd.phase.adjoint_walk             46,336 B       0.04 MiB
    bwd.phase.dqkwg                    50,944 B       0.05 MiB
    bwd.phase.wy                       41,728 B       0.04 MiB
    bwd.phase.grads                    11,008 B       0.01 MiB
  pools (gdn_workspace_layout_kcp: the calls that bind each, its shape and bytes in the arena)
    A            fwd,bwd  [80, 2, 64]                    20,480 B       0.02 MiB
    w            fwd,bwd  [80, 2, 16]                     5,120 B       0.00 MiB
    v_new        fwd,bwd  [80, 2, 16]                     5,120 B       0.00 MiB
    seg_index    fwd,bwd  [56]                              256 B       0.00 MiB
    seg_summary  fwd,bwd  [2, 2, 16, 32]                  8,192 B       0.01 MiB
    summary      fwd      [1, 2, 16, 16]                  2,048 B       0.00 MiB
    c1_send      fwd      [512]                           2,048 B       0.00 MiB
    c1_recv      fwd      [256]                           1,024 B       0.00 MiB
    c2_send      fwd      [256]                           1,024 B       0.00 MiB
    seg_start    fwd,bwd  [2, 2, 16, 16]                  4,096 B       0.00 MiB
    scores       fwd      [80, 2, 64]                    20,480 B       0.02 MiB
    h            bwd      [2, 2, 16, 16]                  2,048 B       0.00 MiB
    dv_new       bwd      [80, 2, 16]                     5,120 B       0.00 MiB
    seg_nu       bwd      [2, 2, 16, 16]                  4,096 B       0.00 MiB
    b1_send      bwd      [0]                                 0 B       0.00 MiB
    b1_recv      bwd      [256]                           1,024 B       0.00 MiB
    b2_send      bwd      [256]                           1,024 B       0.00 MiB
    lam          bwd      [1, 2, 16, 16]                  2,048 B       0.00 MiB
    seg_end      bwd      [2, 2, 16, 16]                  4,096 B       0.00 MiB
    dh           bwd      [2, 2, 16, 16]                  2,048 B       0.00 MiB
    dq_heads     bwd      [80, 2, 16]                     5,120 B       0.00 MiB
    dk_heads     bwd      [80, 2, 16]                     5,120 B       0.00 MiB
    dw           bwd      [80, 2, 16]                     5,120 B       0.00 MiB
    dgcum        bwd      [80, 2]                           768 B       0.00 MiB
  saved for the backward                          0 B       0.00 MiB
    s_in       [0, 2, 16, 16]                        0 B       0.00 MiB
    m          [0, 2, 16, 16]                        0 B       0.00 MiB
  states (initial_state= / final_state of gdn_kcp, gdn_state_layout_kcp)
    initial_state [1, 2, 16, 16]                 2,048 B       0.00 MiB
    final_state   [0, 2, 16, 16]                     0 B       0.00 MiB
  comm (send / recv B): c1 2,048 / 1,024  c2 1,024 / 0  b1 0 / 1,024  b2 1,024 / 2,048

rank 1: tokens [80, 160), 2 fragments, 2 chunks, n_in=1 n_out=0 middle=0
  segments P = 2: 1 summary rows
  workspace (gdn_workspace_bytes_kcp)          50,944 B       0.05 MiB
    fwd.phase.prep                     30,720 B       0.03 MiB
    fwd.phase.segments                 14,592 B       0.01 MiB
    fwd.phase.summary                  14,592 B       0.01 MiB
    fwd.phase.c1                       15,616 B       0.01 MiB
    fwd.phase.c2                       16,640 B       0.02 MiB
    fwd.phase.compose                  16,640 B       0.02 MiB
    fwd.phase.walk                     33,024 B       0.03 MiB  <- largest
    fwd.phase.output                   25,600 B       0.02 MiB
    bwd.phase.prep                     30,720 B       0.03 MiB
    bwd.phase.segments                 35,072 B       0.03 MiB
    bwd.phase.compose                  37,120 B       0.04 MiB
    bwd.phase.walk                     39,168 B       0.04 MiB
    bwd.phase.local_dv                 42,240 B       0.04 MiB
    bwd.phase.segment_nu               44,288 B       0.04 MiB
    bwd.phase.nu                       46,336 B       0.04 MiB
    bwd.phase.b1                       48,384 B       0.05 MiB
    bwd.phase.b2                       46,336 B       0.04 MiB
    bwd.phase.compose_adjoint          46,336 B       0.04 MiB
    bwd.phase.adjoint_walk             42,240 B       0.04 MiB
    bwd.phase.dqkwg                    50,944 B       0.05 MiB  <- largest
    bwd.phase.wy                       41,728 B       0.04 MiB
    bwd.phase.grads                    11,008 B       0.01 MiB
  pools (gdn_workspace_layout_kcp: the calls that bind each, its shape and bytes in the arena)
    A            fwd,bwd  [80, 2, 64]                    20,480 B       0.02 MiB
    w            fwd,bwd  [80, 2, 16]                     5,120 B       0.00 MiB
    v_new        fwd,bwd  [80, 2, 16]                     5,120 B       0.00 MiB
    seg_index    fwd,bwd  [52]                              256 B       0.00 MiB
    seg_summary  fwd,bwd  [1, 2, 16, 32]                  4,096 B       0.00 MiB
    c1_send      fwd      [0]                                 0 B       0.00 MiB
    c1_recv      fwd      [256]                           1,024 B       0.00 MiB
    c2_send      fwd      [256]                           1,024 B       0.00 MiB
    seg_start    fwd,bwd  [1, 2, 16, 16]                  2,048 B       0.00 MiB
    scores       fwd      [80, 2, 64]                    20,480 B       0.02 MiB
    h            bwd      [2, 2, 16, 16]                  2,048 B       0.00 MiB
    dv_new       bwd      [80, 2, 16]                     5,120 B       0.00 MiB
    seg_nu       bwd      [1, 2, 16, 16]                  2,048 B       0.00 MiB
    nu           bwd      [1, 2, 16, 16]                  2,048 B       0.00 MiB
    b1_send      bwd      [512]                           2,048 B       0.00 MiB
    b1_recv      bwd      [256]                           1,024 B       0.00 MiB
    b2_send      bwd      [256]                           1,024 B       0.00 MiB
    lam          bwd      [0, 2, 16, 16]                      0 B       0.00 MiB
    seg_end      bwd      [1, 2, 16, 16]                  2,048 B       0.00 MiB
    dh           bwd      [2, 2, 16, 16]                  2,048 B       0.00 MiB
    dq_heads     bwd      [80, 2, 16]                     5,120 B       0.00 MiB
    dk_heads     bwd      [80, 2, 16]                     5,120 B       0.00 MiB
    dw           bwd      [80, 2, 16]                     5,120 B       0.00 MiB
    dgcum        bwd      [80, 2]                           768 B       0.00 MiB
  saved for the backward                      2,048 B       0.00 MiB
    s_in       [1, 2, 16, 16]                    2,048 B       0.00 MiB
    m          [0, 2, 16, 16]                        0 B       0.00 MiB
  states (initial_state= / final_state of gdn_kcp, gdn_state_layout_kcp)
    initial_state [1, 2, 16, 16]                 2,048 B       0.00 MiB
    final_state   [2, 2, 16, 16]                 4,096 B       0.00 MiB
  comm (send / recv B): c1 0 / 1,024  c2 1,024 / 2,048  b1 2,048 / 1,024  b2 1,024 / 0
""")


def test_json_figures_are_the_queries():
    """Every rank's figures in the JSON are the byte queries' for that rank,
    and ``max`` is their maximum over the ranks."""
    report = budget_json(SMALL)
    bounds, ranges = report["bounds"], [tuple(r) for r in report["rank_ranges"]]
    assert bounds == [0, 300, 300, 1000] and ranges == [(0, 500), (500, 500), (500, 1000)]
    options = OptionsKcp(**report["options"])
    for rank, row in enumerate(report["per_rank"]):
        ctx = context_from_split(bounds, ranges, rank, n_sms=report["sms"])
        args = (ctx, 2, 4, 64, 64)
        assert row["workspace"] == gdn_workspace_bytes_kcp(*args, dtype=torch.bfloat16, options=options)
        layout = gdn_workspace_layout_kcp(*args, dtype=torch.bfloat16, options=options)
        assert {name: pool["bytes"] for name, pool in row["pools"].items()} == layout.pool_bytes
        assert row["phases"] == layout.phases
        assert row["saved_per_layer"] == gdn_saved_bytes_kcp(*args, dtype=torch.bfloat16, options=options)
        comm = gdn_comm_bytes_kcp(ctx, 4, 64, 64, dtype=torch.bfloat16, options=options)
        assert row["comm"] == comm and row["comm_sent"] == sum(c["send"] for c in comm.values())
        assert row["states"] == sum(state["bytes"] for state in row["state_tensors"].values())
    for name, top in report["max"].items():
        assert top == max(row[name] for row in report["per_rank"]), name


def test_layers_multiply_the_saved_set_and_add_one_workspace():
    for layers in (1, 7):
        report = budget_json(f"{SMALL} --layers {layers} --save-mode full")
        models = [row["model"] for row in report["per_rank"]]
        assert models == [layers * row["saved_per_layer"] + row["workspace"] for row in report["per_rank"]]
        top = max(models)
        assert report["model"] == {
            "layers": layers, "rule": "N x saved per layer + one workspace", "bytes": top, "rank": models.index(top),
            "comm_sent_per_step": layers * report["max"]["comm_sent"],
            "comm_rank": [row["comm_sent"] for row in report["per_rank"]].index(report["max"]["comm_sent"])}
    summary = budget(f"{SMALL} --layers 7 --save-mode full")
    assert f"at most {top:,d} B" in summary


def test_with_conv_adds_the_halo_and_conv_size_sets_its_rows():
    """The halo is ``conv_size - 1`` rows of ``2 H_qk K + HV V`` channels: the
    rank after the crossing keeps them (saved ``conv_halo``) and they travel
    as ``halo`` and ``halo_grad``; without --with-conv neither appears."""
    plain = budget_json(SMALL)
    assert all("conv_halo" not in row["saved"] and "halo" not in row["comm"] for row in plain["per_rank"])
    channels = 2 * 2 * 64 + 4 * 64
    for conv_size in (2, 4):
        report = budget_json(f"{SMALL} --with-conv --conv-size {conv_size}")
        assert report["options"]["with_conv"] and report["options"]["conv_size"] == conv_size
        last = report["per_rank"][2]
        assert last["saved"]["conv_halo"] == {"shape": [conv_size - 1, channels], "dtype": "bfloat16",
                                              "bytes": (conv_size - 1) * channels * 2}
        assert last["saved_per_layer"] == plain["per_rank"][2]["saved_per_layer"] + last["saved"]["conv_halo"]["bytes"]
        assert last["comm"]["halo"]["recv"] > 0 and report["per_rank"][0]["comm"]["halo"]["send"] > 0
        assert [row["workspace"] for row in report["per_rank"]] == [row["workspace"] for row in plain["per_rank"]]


def test_kda_figures_are_the_kda_queries():
    """--kda answers for kda_kcp calls: every rank's workspace, saved set and
    traffic are the kda_* queries' (the workspace above GDN's by the
    per-channel gate gradient; the saved set and the traffic GDN's)."""
    from gdn_kcp import kda_comm_bytes_kcp, kda_saved_bytes_kcp, kda_workspace_bytes_kcp

    plain, report = budget_json(SMALL), budget_json(SMALL + " --kda")
    assert report["options"]["gate"] == "channel"
    for rank, (row, gdn_row) in enumerate(zip(report["per_rank"], plain["per_rank"])):
        ctx = context_from_split(report["bounds"], [tuple(r) for r in report["rank_ranges"]], rank,
                                 n_sms=report["sms"])
        args = (ctx, 2, 4, 64, 64)
        assert row["workspace"] == kda_workspace_bytes_kcp(*args, dtype=torch.bfloat16)
        assert row["workspace"] > gdn_row["workspace"] or row["tokens"] == [500, 500], rank  # the empty rank: equal
        assert row["saved_per_layer"] == kda_saved_bytes_kcp(*args, dtype=torch.bfloat16) == gdn_row["saved_per_layer"]
        assert row["comm"] == kda_comm_bytes_kcp(ctx, 4, 64, 64, dtype=torch.bfloat16) == gdn_row["comm"]


def test_json_keys_are_pinned():
    """Scripts read these keys: adding or renaming one is a deliberate change."""
    report = budget_json(SMALL)
    assert sorted(report) == sorted([
        "tokens", "documents", "bounds", "ranks", "rank_ranges", "H_qk", "HV", "K", "V", "dtype", "options", "sms",
        "max_docs", "plan_segments", "layers", "per_rank", "max", "model"])
    assert sorted(report["per_rank"][0]) == sorted([
        "rank", "tokens", "fragments", "chunks", "n_in", "n_out", "middle", "segments", "summary_rows", "workspace",
        "saved_per_layer", "states", "comm_sent", "comm_recv", "model", "workspace_fwd", "workspace_bwd", "phases",
        "pools", "saved", "state_tensors", "comm"])


def test_the_example_in_docs_bytes_is_the_commands_output():
    text = doc("bytes.md")
    block = re.search(r"<!-- budget-summary -->\n```text\n\$ python -m gdn_kcp ([^\n]*)\n(.*?)```", text, re.S)
    assert block, "docs/bytes.md lost its budget example"
    assert budget(block[1]) == block[2]
