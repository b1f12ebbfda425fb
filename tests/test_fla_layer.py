"""flash-linear-attention's own layer, given the same state dict, gives our layer's
outputs, gradients and generated steps (tools/fla_layer_check.py). FLA's kernels
need triton 3.6 and FLA's packages in a folder of their own, so this runs from
``make fla-layer-check`` (which downloads them) and is skipped in CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SITE = os.environ.get("GDN_KCP_FLA_SITE")
TOOL = Path(__file__).resolve().parents[1] / "tools" / "fla_layer_check.py"


@pytest.mark.skipif(not SITE, reason="FLA's layer needs its own site: make fla-layer-check")
def test_fla_layer_with_our_state_dict_gives_our_outputs():
    done = subprocess.run([sys.executable, str(TOOL), "--site", SITE], capture_output=True, text=True,
                          timeout=1800)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "all within" in done.stdout
