"""Not CI: flash-linear-attention's own KDA tests (``tests/ops/test_kda.py``) on
the CPU with gdn_kcp's ``chunk_kda`` and ``fused_recurrent_kda`` in place of
FLA's, FLA's torch references (``naive_recurrent_kda``, ``naive_kda_gate``,
``naive_kda_lowerbound_gate``) the oracle. ``make fla-kda-suite`` runs it as a
pytest plugin (``-p fla_kda_swap``) over that file from a checkout of FLA
(``FLA_TESTS``), with fla-core 0.6.0 from the package index for FLA's
references and helpers.

Before FLA's test module is imported, the plugin points FLA's ``device`` at
the CPU and puts our two functions into ``fla.ops.kda``, so the module's
``from fla.ops.kda import chunk_kda, fused_recurrent_kda`` takes ours. It
leaves out the tests that do not call ours (FLA's naive-against-naive check,
its Triton gate and vLLM decode kernels, its backend routing, flash-kda),
skips the one case too large for a 24 GiB host, and marks as expected
failures the calls we refuse by design (docs/testing.md, "FLA's own KDA
tests"); everything else must pass at FLA's tolerances.
``FLA_CI_ENV`` (which turns FLA's failures into warnings) must be unset.
"""

from __future__ import annotations

import os

import pytest

NOT_OURS = {
    "test_naive_chunk": "FLA's naive chunk form against its naive recurrence: no call of ours",
    "test_gate": "FLA's Triton gate kernel (fused_kda_gate) against its torch gate: no call of ours",
    "test_fused_recurrent_vllm_decode": "FLA's fused_recurrent_kda_fwd kernel with vLLM's state indices",
    "test_flash_kda_chunk": "the flash_kda backend of FLA",
    "test_flash_kda_chunk_varlen": "the flash_kda backend of FLA",
    "test_triton_ascend_backend_routing": "FLA's backend registry",
}
"""Tests left out, with why: none of them calls chunk_kda or fused_recurrent_kda of ours."""

TOO_LARGE = {
    "B1-T8192-H96-D128": "T = 8192, HV = 96, K = 128 twice (its oracle is chunk_kda itself, with the sigmoid "
                         "outside): the torch programs' chunk layouts need more than a 24 GiB machine holds; a "
                         "failed case's traceback then pins that memory for the rest of the run",
}
"""Test ids (substrings) skipped for the host's memory, with why."""

REFUSED_BY_DESIGN = {
    "chunk_size32": ("chunk_size=32: the programs cut chunks of 64 tokens only (a ValueError naming chunk_size)",
                     ValueError),
    "test_chunk_invalid_chunk_size": ("chunk_size=16 is refused (ValueError) in our words, which FLA's "
                                      "pytest.raises(match=...) does not match", AssertionError),
    "test_chunk_return_intermediate_states": ("return_intermediate_states=True (FLA's inference form) is refused",
                                              ValueError),
}
"""Test ids (substrings) whose call we refuse by design, the error the test then meets: expected to fail."""


def pytest_configure(config) -> None:
    if os.environ.get("FLA_CI_ENV"):
        raise pytest.UsageError("unset FLA_CI_ENV: it turns FLA's tolerance failures into warnings")
    import fla.ops.kda
    import fla.utils
    import fla.utils.hardware

    from gdn_kcp import kda

    for module in (fla.utils, fla.utils.hardware):
        module.device = "cpu"
    fla.ops.kda.chunk_kda = kda.chunk_kda
    fla.ops.kda.fused_recurrent_kda = kda.fused_recurrent_kda


def pytest_collection_modifyitems(config, items) -> None:
    kept, left_out = [], []
    for item in items:
        name = item.originalname if hasattr(item, "originalname") else item.name
        if name in NOT_OURS:
            left_out.append(item)
            continue
        for key, why in TOO_LARGE.items():
            if key in item.nodeid:
                item.add_marker(pytest.mark.skip(reason=why))
        for key, (why, error) in REFUSED_BY_DESIGN.items():
            if key in item.nodeid:
                item.add_marker(pytest.mark.xfail(reason=why, raises=error, strict=True))
        kept.append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
    items[:] = kept
