"""FakeTensor memory tracing of FLA-style code: the FLA entry with a tensor
``cu_seqlens``, ``gdn_kcp`` on a context built from a fake tensor, and the
layer trace under FakeTensorMode with no host read, and MemTracker's peak
equals the real run's, on one rank and on two (capped contexts)."""

from __future__ import annotations

import pytest
import torch
from fake_tracing_cases import BOUNDS, MAX_DOCS, T, check_fake_peaks_on_rank, real_and_fake_peaks
from spawn import spawn_ranks
from torch._subclasses.fake_tensor import FakeTensorMode

from gdn_kcp import build_kcp_context


@pytest.mark.parametrize("step", ["fla", "kcp", "layer", "layer_kcp"])
def test_fake_peak_equals_the_real_run(step):
    real, fake = real_and_fake_peaks(step)
    assert fake == real
    assert real["Total"] > 0


def test_fake_peaks_on_two_ranks():
    spawn_ranks(2, check_fake_peaks_on_rank)


def test_a_context_from_a_fake_tensor():
    """Capped, with the caps of the same context built from host bounds; the
    rows of its documents are data on the device, and say so."""
    host = build_kcp_context(BOUNDS, max_docs=MAX_DOCS)
    with FakeTensorMode():
        cu = torch.tensor(BOUNDS)
        fake = build_kcp_context(cu, max_docs=MAX_DOCS, n_tokens=T)
        assert fake.layout_key == host.layout_key
        with pytest.raises(ValueError, match="data on the device"):
            fake.start_docs
        with pytest.raises(ValueError, match="pass max_docs="):
            build_kcp_context(cu)
        with pytest.raises(ValueError, match="pass n_tokens="):
            build_kcp_context(cu, max_docs=MAX_DOCS)
        ranged = build_kcp_context(cu, max_docs=MAX_DOCS, rank_ranges=[(0, T)])
        assert ranged.layout_key == host.layout_key
        listed = build_kcp_context(BOUNDS, max_docs=MAX_DOCS)  # host bounds: the rows are known
        assert (listed.start_docs, listed.end_docs) == (host.start_docs, host.end_docs) == ([0, 1, 2, 3, 4],) * 2


def test_n_tokens_is_checked_against_readable_bounds():
    with pytest.raises(ValueError, match="must end at T = 129"):
        build_kcp_context(torch.tensor(BOUNDS), n_tokens=129)
    with pytest.raises(ValueError, match="n_tokens must be an int"):
        build_kcp_context(BOUNDS, n_tokens=-1)
