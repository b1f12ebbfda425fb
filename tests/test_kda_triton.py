"""KDA (a gate per key channel) through the host path on the Triton programs,
run on the CPU under Triton's interpreter: chunk_kda against the fp64 naive
KDA recurrence in each save mode, and kda_kcp on two gloo ranks (a2a with
states, ring capped, intra-rank segments) against the single-rank run: what
CUDA runs, short of the GPU. CI runs the gate-in-kernel case; the others
(``extended``, about 3 minutes) run in make test-extended."""

from __future__ import annotations

import pytest
import torch
from kcp_cases import KcpCase, check_case_on_rank, reference
from spawn import spawn_ranks
from test_kda import assert_exact, compare, kda_inputs

from gdn_kcp.host.programs import count_programs, use_programs

TRITON_PROGRAMS = {"prep", "tape_walk", "bwd_local_dv", "adjoint_walk", "bwd_dqkwg", "bwd_wy", "bwd_gate_cumsum"}
"""Programs every chunk_kda step here launches (and the mode's forward
output path: ``scores`` and ``walk_output``, or ``output``)."""


@pytest.mark.extended
@pytest.mark.parametrize("keywords", [{}, dict(save_mode="inverse"), dict(disable_recompute=True)], ids=str)
def test_chunk_kda_on_the_triton_programs_matches_the_oracle(keywords):
    """fp64, in-kernel q/k norm, initial states, a document of one token and
    the hard resets and -1000 gates of ``gdn_inputs.channel_gates``: o, the
    final states and every gradient within 1e-9 of the oracle, as on the
    torch programs (tests/test_kda.py)."""
    inputs = kda_inputs(70, 1, 2, 16, 24, seed=11)
    with use_programs("cpu", "triton"), count_programs() as launched:
        results = compare(inputs, [0, 33, 34, 70], l2=True, h0=True, **keywords)
    assert_exact(results, f"triton {keywords}")
    assert TRITON_PROGRAMS <= set(launched), launched


def test_gate_in_kernel_on_the_triton_programs():
    """FLA's softplus gate in kernel (``[2, HV, K]`` parameters read by every
    program) and beta's sigmoid in kernel, fp64, with the norm, initial
    states and two documents, against the oracle on the gate and beta by
    hand, A_log's and dt_bias's gradients included (CI's case of the host
    path on the Triton programs)."""
    from gdn_kcp import kda_gate

    inputs = kda_inputs(40, 1, 2, 16, 16, seed=3)
    gen = torch.Generator().manual_seed(5)
    extra = dict(A_log=torch.randn(2, generator=gen, dtype=torch.float64),
                 dt_bias=torch.randn(32, generator=gen, dtype=torch.float64))
    with use_programs("cpu", "triton"):
        results = compare(inputs, [0, 17, 40], l2=True, h0=True, extra=extra, gate=kda_gate,
                          beta_fn=torch.sigmoid, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    assert_exact(results, "triton gate in kernel")


KCP_CASE = KcpCase("kda-triton", (0, 40, 41, 150), ((0, 70), (70, 150)), H_qk=1, HV=2, K=16, V=16, l2=True,
                   kda=True)


KCP_RUNS = {"a2a-states": ("a2a", True, None, None), "ring-capped": ("ring", False, 5, None),
            "segments": ("a2a", False, None, 2)}
"""``(exchange, states, max_docs, segments)`` per run, each 20 to 40 s under
the interpreter: make test-extended (CI runs kda_kcp on the torch programs
and every KDA Triton program against its twin)."""


def _triton_kcp_on_rank(rank: int, R: int, run: str) -> None:
    exchange, states, max_docs, segments = KCP_RUNS[run]
    with use_programs("cpu", "triton"):
        inputs, given, expected = reference(KCP_CASE, states, max_docs)
        check_case_on_rank(KCP_CASE, rank, exchange, inputs, given, expected, max_docs, segments=segments)


@pytest.mark.extended
@pytest.mark.parametrize("run", sorted(KCP_RUNS))
def test_kda_kcp_on_the_triton_programs_equals_one_rank(run):
    """kda_kcp on two gloo ranks, each on the Triton programs (the KCP summary
    walk, the adjoint summary, the compositions and, with segments, the
    segment summaries with a gate per key channel): every output and
    gradient, the states and the counted traffic equal the single-rank run
    (``kcp_cases.check_case_on_rank``)."""
    spawn_ranks(2, _triton_kcp_on_rank, run)
