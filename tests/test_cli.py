"""``python -m gdn_kcp``: its help (every default shown) and every refusal are
pinned outputs; a bad argument is refused by argparse (exit 2, a message
naming it) before anything is printed or spawned; the KCP demo's packing works
for every token count it accepts. Pinned outputs are expecttest's:
``EXPECTTEST_ACCEPT=1 pytest tests/test_cli.py`` rewrites them after a
deliberate change (docs/testing.md)."""

from __future__ import annotations

import contextlib
import io
import os
from unittest import mock

import expecttest
import pytest

from gdn_kcp.__main__ import main
from gdn_kcp.context import default_ranges
from gdn_kcp.demo.kcp import packed_bounds

REFUSED = [
    "budget --ranks 0",
    "budget --max-docs 0",
    "budget --n-docs 9 --max-docs 8",
    "budget --ranks -1",
    "budget --ranks two",
    "budget --tokens -5",
    "budget --tokens 0",
    "budget --n-docs 0",
    "budget --hq 0",
    "budget --k -128",
    "budget --docs 10,-2",
    "budget --docs 10,x",
    "budget --docs 0,0",
    "budget --docs 10,20 --tokens 31",
    "budget --docs 10 --ranks 3 --rank-tokens 5,5",
    "budget --docs 10 --ranks 2 --rank-tokens 5,6",
    "budget --hq 3 --hv 8",
    "budget --save-mode full --no-save-for-backward",
    "budget --conv-size 0 --with-conv",
    "budget --layers 0",
    "demo --ranks 0",
    "demo --ranks -1",
    "demo --ranks 65",
    "demo --kcp-tokens 0",
    "demo --ranks 4 --kcp-tokens 3",
    "demo --steps -1",
    "demo --tokens 0",
    "demo --layer rnn",
]


def run_cli(argv: str) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``python -m gdn_kcp argv``, in this
    process, at a fixed width (argparse wraps help to the terminal's)."""
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, {"COLUMNS": "100", "NO_COLOR": "1"}), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv.split())
            code = 0
        except SystemExit as exit_info:
            code = exit_info.code
    return code, out.getvalue(), err.getvalue()


class PinnedOutputs(expecttest.TestCase):
    def test_every_refusal_exits_2_before_any_output(self):
        lines = []
        for argv in REFUSED:
            code, out, err = run_cli(argv)
            self.assertEqual((code, out), (2, ""), argv)
            self.assertTrue(err.startswith("usage: python -m gdn_kcp " + argv.split()[0]), err)
            lines.append(f"{argv}\n  {err.strip().splitlines()[-1]}")
        self.assertExpectedInline("\n".join(lines), """\
budget --ranks 0
  python -m gdn_kcp budget: error: argument --ranks: must be a positive integer, got 0
budget --max-docs 0
  python -m gdn_kcp budget: error: argument --max-docs: must be a positive integer, got 0
budget --n-docs 9 --max-docs 8
  python -m gdn_kcp budget: error: argument --max-docs: the packing holds 9 documents, more than max_docs = 8
budget --ranks -1
  python -m gdn_kcp budget: error: argument --ranks: must be a positive integer, got -1
budget --ranks two
  python -m gdn_kcp budget: error: argument --ranks: must be an integer, got 'two'
budget --tokens -5
  python -m gdn_kcp budget: error: argument --tokens: must be a positive integer, got -5
budget --tokens 0
  python -m gdn_kcp budget: error: argument --tokens: must be a positive integer, got 0
budget --n-docs 0
  python -m gdn_kcp budget: error: argument --n-docs: must be a positive integer, got 0
budget --hq 0
  python -m gdn_kcp budget: error: argument --hq: must be a positive integer, got 0
budget --k -128
  python -m gdn_kcp budget: error: argument --k: must be a positive integer, got -128
budget --docs 10,-2
  python -m gdn_kcp budget: error: argument --docs: lengths must not be negative, got -2 in '10,-2'
budget --docs 10,x
  python -m gdn_kcp budget: error: argument --docs: must be comma-separated integers, got '10,x'
budget --docs 0,0
  python -m gdn_kcp budget: error: argument --docs: the documents hold no token, got [0, 0]
budget --docs 10,20 --tokens 31
  python -m gdn_kcp budget: error: argument --docs: the lengths add up to 30 tokens, --tokens says 31
budget --docs 10 --ranks 3 --rank-tokens 5,5
  python -m gdn_kcp budget: error: argument --rank-tokens: lists 2 ranks, --ranks says 3
budget --docs 10 --ranks 2 --rank-tokens 5,6
  python -m gdn_kcp budget: error: argument --rank-tokens: adds up to 11 tokens, the stream has T = 10
budget --hq 3 --hv 8
  python -m gdn_kcp budget: error: argument --hv: HV = 8 must be a multiple of --hq = 3
budget --save-mode full --no-save-for-backward
  python -m gdn_kcp budget: error: save_mode='full' keeps the forward tapes, but save_for_backward=False keeps no saved set
budget --conv-size 0 --with-conv
  python -m gdn_kcp budget: error: argument --conv-size: must be a positive integer, got 0
budget --layers 0
  python -m gdn_kcp budget: error: argument --layers: must be a positive integer, got 0
demo --ranks 0
  python -m gdn_kcp demo: error: argument --ranks: must be an integer from 1 to 64, got 0
demo --ranks -1
  python -m gdn_kcp demo: error: argument --ranks: must be an integer from 1 to 64, got -1
demo --ranks 65
  python -m gdn_kcp demo: error: argument --ranks: must be an integer from 1 to 64, got 65
demo --kcp-tokens 0
  python -m gdn_kcp demo: error: argument --kcp-tokens: must be a positive integer, got 0
demo --ranks 4 --kcp-tokens 3
  python -m gdn_kcp demo: error: argument --kcp-tokens: must be at least --ranks = 4 (every rank holds a token), got 3
demo --steps -1
  python -m gdn_kcp demo: error: argument --steps: must be a non-negative integer, got -1
demo --tokens 0
  python -m gdn_kcp demo: error: argument --tokens: must be a positive integer, got 0
demo --layer rnn
  python -m gdn_kcp demo: error: argument --layer: invalid choice: 'rnn' (choose from 'gdn', 'kda')""")

    def test_budget_help_shows_every_default(self):
        code, out, err = run_cli("budget --help")
        self.assertEqual((code, err), (0, ""))
        self.assertExpectedInline(out, """\
usage: python -m gdn_kcp budget [-h] [--tokens TOKENS] [--ranks RANKS] [--docs DOCS]
                                [--n-docs N_DOCS] [--seed SEED] [--rank-tokens RANK_TOKENS]
                                [--hq HQ] [--hv HV] [--k K] [--v V]
                                [--dtype {bf16,fp16,fp32,fp64}] [--save-mode {light,inverse,full}]
                                [--boundary-mode {saved,replay}] [--save-transfer]
                                [--no-save-for-backward] [--graph {off,replay}]
                                [--exchange {a2a,ring}] [--l2] [--with-conv]
                                [--conv-size CONV_SIZE] [--kda] [--sms SMS] [--segments SEGMENTS]
                                [--max-docs MAX_DOCS] [--layers LAYERS] [--detail] [--json]

Bytes every rank will hold, from the byte queries (no GPU, no process group). First a summary: per
rank the workspace, the saved set of one layer, its states and its traffic, then their maximum
over the ranks, and a model of --layers N layers per rank: N x saved per layer + one workspace
(each layer's saved set lives from its forward to its backward; one workspace serves every layer,
since a call releases its pools before it returns). --detail adds every phase, pool, saved tensor
and collective; --json prints all of it for scripts.

options:
  -h, --help            show this help message and exit
  --tokens TOKENS       T of the packed stream; if not given, the sum of --docs, or 32768 for a
                        random packing (default: None)
  --ranks RANKS         R, ranks of the group (default: 1)
  --docs DOCS           document lengths, comma-separated; if not given, a random packing (see
                        --n-docs) (default: None)
  --n-docs N_DOCS       documents of the random packing (default: 8)
  --seed SEED           seed of the random packing (default: 0)
  --rank-tokens RANK_TOKENS
                        tokens per rank, comma-separated; if not given, the even split (default:
                        None)
  --hq HQ               H_qk, key heads (default: 16)
  --hv HV               HV, value heads (a multiple of --hq) (default: 32)
  --k K                 K, key head dim (default: 128)
  --v V                 V, value head dim (default: 128)
  --dtype {bf16,fp16,fp32,fp64}
                        input dtype (default: bf16)
  --save-mode {light,inverse,full}
                        OptionsKcp.save_mode: light keeps no tape, inverse keeps A (and the q/k
                        norms), full keeps A, w, v_new, h (default: light)
  --boundary-mode {saved,replay}
                        OptionsKcp.boundary_mode: keep S_in (and M) for the backward, or replay
                        the exchange (default: saved)
  --save-transfer       OptionsKcp.save_transfer: owners keep M for b1 (a2a only) (default: False)
  --no-save-for-backward
                        OptionsKcp(save_for_backward=False): no saved set, the backward replays
                        the forward (default: False)
  --graph {off,replay}  OptionsKcp.graph: replay accounts for a CUDA-graph-captured call (default:
                        off)
  --exchange {a2a,ring}
                        OptionsKcp.exchange: how boundary states travel (default: a2a)
  --l2                  in-kernel q/k L2 norm (OptionsKcp.use_qk_l2norm) (default: False)
  --with-conv           count the short convolution's halo of a GatedDeltaNet layer under KCP
                        (OptionsKcp.with_conv): the saved set gains conv_halo, the traffic halo
                        and halo_grad (default: False)
  --conv-size CONV_SIZE
                        that convolution's width (OptionsKcp.conv_size; read with --with-conv)
                        (default: 4)
  --kda                 KDA calls (kda_kcp, a gate per key channel; OptionsKcp.gate='channel'):
                        the kda_* queries (default: False)
  --sms SMS             streaming multiprocessors the segment plan fills (an H100 / H200 SXM has
                        132) (default: 132)
  --segments SEGMENTS   intra-rank segments P; if not given, the plan's (default: None)
  --max-docs MAX_DOCS   a capped context (build_kcp_context(max_docs=)): figures for every packing
                        of up to this many documents; if not given, the exact context of this
                        packing (default: None)
  --layers LAYERS       N, GDN layers of the model: its estimate per rank is N x the saved set of
                        one layer + one workspace (every layer's saved set lives from its forward
                        to its backward; the workspace is bound by one call at a time), and N x
                        one layer's traffic per step (default: 1)
  --detail              after the summary, every phase, pool, saved tensor, state and collective
                        of every rank (default: False)
  --json                print every figure (the detail included) as one JSON object instead of
                        text (default: False)
""")

    def test_demo_help_shows_every_default(self):
        code, out, err = run_cli("demo --help")
        self.assertEqual((code, err), (0, ""))
        self.assertExpectedInline(out, """\
usage: python -m gdn_kcp demo [-h] [--ranks RANKS] [--kcp-tokens KCP_TOKENS] [--steps STEPS]
                              [--tokens TOKENS] [--lm-steps LM_STEPS] [--lm-bytes LM_BYTES]
                              [--layer {gdn,kda}] [--lm-compile]

options:
  -h, --help            show this help message and exit
  --ranks RANKS         processes of the KCP run (gloo), 1 to 64 (default: 4)
  --kcp-tokens KCP_TOKENS
                        packed tokens of the KCP run, at least --ranks (every rank holds a token)
                        (default: 4096)
  --steps STEPS         training steps of the single-rank layer (default: 60)
  --tokens TOKENS       tokens per training batch (default: 1024)
  --lm-steps LM_STEPS   training steps of the byte LM (KCP over --ranks processes) (default: 120)
  --lm-bytes LM_BYTES   bytes per rank per step of the byte LM (default: 256)
  --layer {gdn,kda}     the byte LM's token mixer: GatedDeltaNet (gdn) or KimiDeltaAttention (kda,
                        a gate per key channel) (default: gdn)
  --lm-compile          run the byte LM under torch.compile(fullgraph=True): one graph for every
                        packing (compiling takes minutes on 2 cores) (default: False)
""")

    def test_demo_packing_of_the_default_run(self):
        self.assertExpectedInline(str(packed_bounds(4096, 4)), """[0, 37, 37, 127, 512, 3584, 3757, 3930, 4096]""")


@pytest.mark.parametrize("R", [1, 2, 3, 4, 5, 8])
def test_demo_packing_crosses_every_rank_at_any_size(R):
    """For every T >= R: valid bounds, and one document from rank 0 to the last rank."""
    for T in [*range(R, 300), 4096, 4099]:
        bounds = packed_bounds(T, R)
        assert bounds[0] == 0 and bounds[-1] == T, (T, R, bounds)
        assert all(a <= b for a, b in zip(bounds, bounds[1:])), (T, R, bounds)
        ranges = default_ranges(T, R)
        assert any(a < ranges[0][1] and b > ranges[-1][0] for a, b in zip(bounds, bounds[1:])), (T, R, bounds)
