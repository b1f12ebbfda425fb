"""Not CI: flash-linear-attention's own op tests on the CPU with gdn_kcp's
functions in place of FLA's, FLA's torch references the oracle, at FLA's own
tolerances. ``make fla-kda-suite`` and ``make fla-gdn-suite`` run it as a
pytest plugin (``-p fla_swap``) over FLA's test files from a checkout of FLA
(``FLA_TESTS``), with fla-core 0.6.0 from the package index for FLA's
references and helpers. ``FLA_SWAP_SUITE`` names the suite (``kda`` or
``gdn``, :data:`SUITES`).

Before FLA's test modules are imported, the plugin points FLA's ``device`` at
the CPU and puts our functions into FLA's op package, so the modules'
``from fla.ops.<op> import ...`` take ours. It leaves out the tests that do
not call ours (each named, with why), skips the one case too large for a
24 GiB host, and marks nothing as an expected failure: every test that calls
ours must pass. A name in the lists that no collected test has is an error,
so the lists cannot go stale silently (checked when the whole suite runs). ``FLA_CI_ENV`` (which turns FLA's
failures into warnings) must be unset.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest


@dataclass(frozen=True)
class Suite:
    """One FLA op package and its test files: what is swapped, what is left out."""

    package: str
    """FLA's op package our functions are put into (``fla.ops.kda``)."""
    files: tuple[str, ...]
    """FLA's test files of the suite (``tests/ops/<file>`` in FLA's checkout)."""
    swapped: tuple[str, ...]
    """The names put there, each ``gdn_kcp``'s function of the same name."""
    not_ours: dict[str, str] = field(default_factory=dict)
    """Test functions left out, with why: none of them calls a function of ours."""
    too_large: dict[str, str] = field(default_factory=dict)
    """Test ids (substrings) skipped for the host's memory, with why."""
    interpreted: str = ""
    """Why FLA's own Triton kernels must run (under Triton's interpreter), if they must."""
    environment: dict[str, str] = field(default_factory=dict)
    """Variables set before FLA imports, each so that a case runs that would skip."""


GDN_INTERNALS = "one of FLA's GDN kernels (its chunk-form stages or gate) against FLA's torch reference of it"

SUITES = {
    "kda": Suite(
        package="fla.ops.kda",
        files=("test_kda.py",),
        swapped=("chunk_kda", "fused_recurrent_kda"),
        not_ours={
            "test_naive_chunk": "FLA's naive chunk form against its naive recurrence",
            "test_gate": "FLA's Triton gate kernel (fused_kda_gate) against its torch gate",
            "test_fused_recurrent_vllm_decode": "FLA's fused_recurrent_kda_fwd kernel with vLLM's state indices",
            "test_flash_kda_chunk": "the flash_kda backend of FLA",
            "test_flash_kda_chunk_varlen": "the flash_kda backend of FLA",
            "test_triton_ascend_backend_routing": "FLA's backend registry",
        },
        too_large={
            "B1-T8192-H96-D128": "T = 8192, HV = 96, K = 128 twice (its oracle is chunk_kda itself, with the sigmoid "
                                 "outside): the torch programs' chunk layouts need more than a 24 GiB machine holds; "
                                 "a failed case's traceback then pins that memory for the rest of the run",
        },
    ),
    "gdn": Suite(
        package="fla.ops.gated_delta_rule",
        files=("test_gdn.py", "test_gdn_kernels.py"),
        swapped=("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
        not_ours={
            "test_chunk_gated_delta_rule_fwd_h_blackwell_triton_guard": "FLA's Blackwell guard of its h kernel",
            "test_gate": "FLA's Triton gate kernel (fused_gdn_gate) against its torch gate",
            "test_prepare_wy_repr_bwd_no_g": "FLA's prepare_wy_repr_bwd with and without g",
            **{name: "FLA's FlashQLA backend verifier or its SM120 flag" for name in (
                "test_flash_qla_verifier_rejects", "test_flash_qla_verifier_sm120_accepts_forward",
                "test_flash_qla_verifier_sm120_rejects_backward", "test_flash_qla_verifier_sm120_rejects_float16",
                "test_flash_qla_sm120_flag_is_exact_capability")},
            **{name: GDN_INTERNALS for name in (
                "test_recompute_w_u_fwd", "test_chunk_kkt_solve", "test_gdn_gate_fwd", "test_gdn_gate_chunk_cumsum",
                "test_chunk_fwd_o", "test_chunk_gated_delta_rule_fwd_h",
                "test_chunk_gated_delta_rule_fwd_h_varlen_many_documents", "test_chunk_bwd_dv_local",
                "test_chunk_bwd_dqkwg", "test_gdn_gate_bwd", "test_prepare_wy_repr_bwd",
                "test_recompute_w_u_fwd_varlen", "test_prepare_wy_repr_bwd_varlen",
                "test_chunk_gated_delta_rule_bwd_dhu", "test_chunk_gated_delta_rule_bwd_dhu_k256_state_v_first_gk",
                "test_chunk_gated_delta_rule_bwd_dhu_varlen_many_documents")},
        },
        interpreted="test_gdn_full_bwd makes its gate with FLA's Triton gdn_gate_chunk_cumsum",
        # FLA's GQA cases (HV != H) of test_chunk, test_chunk_beta_sigmoid_in_kernel and test_chunk_gate_in_kernel_gqa
        # skip while FLA's backend dispatch is on (its tilelang backend has no GQA); ours replaces the op either way
        environment={"FLA_DISABLE_BACKEND_DISPATCH": "1"},
    ),
}


def suite() -> Suite:
    name = os.environ.get("FLA_SWAP_SUITE", "")
    if name not in SUITES:
        raise pytest.UsageError(f"FLA_SWAP_SUITE must name one of {sorted(SUITES)}, got {name!r}")
    return SUITES[name]


def interpret_first_config() -> None:
    """Triton's interpreter for FLA's kernels (set before FLA imports Triton;
    gdn_kcp's CPU path is its torch programs either way), each autotuned
    kernel at its first configuration: the interpreter cannot time them.
    Must run before FLA's modules define their kernels."""
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime import autotuner

    init = autotuner.Autotuner.__init__

    def first_config(self, fn, arg_names, configs, *args, **kwargs):
        init(self, fn, arg_names, configs[:1], *args, **kwargs)

    autotuner.Autotuner.__init__ = first_config


def pytest_configure(config) -> None:
    if os.environ.get("FLA_CI_ENV"):
        raise pytest.UsageError("unset FLA_CI_ENV: it turns FLA's tolerance failures into warnings")
    if os.environ.get("SKIP_TEST_CHUNK_VARLEN"):
        raise pytest.UsageError("unset SKIP_TEST_CHUNK_VARLEN: it skips FLA's varlen tests")
    import importlib

    chosen = suite()
    os.environ.update(chosen.environment)
    if chosen.interpreted:
        interpret_first_config()

    import fla.utils
    import fla.utils.hardware

    import gdn_kcp

    for module in (fla.utils, fla.utils.hardware):
        module.device = "cpu"
    package = importlib.import_module(chosen.package)
    for name in chosen.swapped:
        setattr(package, name, getattr(gdn_kcp, name))


def pytest_collection_modifyitems(config, items) -> None:
    chosen = suite()
    kept, left_out, seen = [], [], set()
    for item in items:
        name = getattr(item, "originalname", item.name)
        seen.add(name)
        if name in chosen.not_ours:
            left_out.append(item)
            continue
        for key, why in chosen.too_large.items():
            if key in item.nodeid:
                seen.add(key)
                item.add_marker(pytest.mark.skip(reason=why))
        kept.append(item)
    whole = not config.option.keyword and not config.option.markexpr and set(chosen.files) <= {
        item.path.name for item in items}
    stale = sorted((set(chosen.not_ours) | set(chosen.too_large)) - seen)
    if whole and stale:  # a run of part of the suite sees part of the names
        raise pytest.UsageError(f"fla_swap names tests that FLA's files no longer have: {stale}")
    if left_out:
        config.hook.pytest_deselected(items=left_out)
    items[:] = kept
