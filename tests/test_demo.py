"""``python -m gdn_kcp demo`` runs where numpy is not installed (numpy is a test
extra, not a dependency): a fresh ``make demo`` venv has none."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def no_numpy_env(tmp_path) -> dict[str, str]:
    """The environment with a ``numpy`` package first on the path whose import
    fails as a missing one does; spawned processes inherit it."""
    blocker = tmp_path / "numpy"
    blocker.mkdir()
    (blocker / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'numpy\'", name="numpy")\n')
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    return env


def test_demo_runs_without_numpy(tmp_path):
    env = no_numpy_env(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import numpy"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'numpy'" in probe.stderr
    # Small sizes; the KCP part spawns its 2 rank processes, which gather their reports.
    argv = ["-m", "gdn_kcp", "demo", "--ranks", "2", "--kcp-tokens", "64", "--steps", "1", "--tokens", "64",
            "--lm-steps", "2", "--lm-bytes", "64"]
    run = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("KCP: 64 packed tokens")
    rows = [line for line in lines if line.split()[:2] in (["0", "0-32"], ["1", "32-64"])]
    assert len(rows) == 4 and all(line.endswith("yes") for line in rows), run.stdout  # two per exchange
    kept = next(i for i, line in enumerate(lines) if line.startswith("  checkpoint: the recompute"))
    assert "kept the tapes, launched no output" in lines[kept], run.stdout
    launched, plain = re.match(r" +(\d+) program launches a step \((\d+) without", lines[kept + 1]).groups()
    assert launched == plain, lines[kept + 1]  # the checkpointed core costs no launch
    oracle = lines.index("max |chunked fp32 - naive fp64 oracle| on the trained layer:")
    assert lines[oracle + 3].startswith("training a 2-layer GatedDeltaNet byte LM")
    held_out = [line for line in lines if "held-out" in line and "bits per byte" in line]
    assert len(held_out) == 3, run.stdout  # steps 0, 1 and 2
    continuation = next(i for i, line in enumerate(lines) if line.startswith("greedy continuation of a held-out file"))
    assert "120 bytes generated with the decode caches" in lines[continuation]
    assert lines[continuation + 1] == "--- prompt ---" and "--- continuation ---" in lines[continuation + 2:]


@pytest.mark.parametrize("layer", ["gdn", "kda"])
def test_generation_through_the_caches_equals_the_full_forward(layer):
    """The byte LM's cached decoding (prefill, then one step per byte) gives
    the logits of running the whole sequence at once, so its greedy bytes are
    the full forward's argmax at every position (GatedDeltaNet's and
    KimiDeltaAttention's layers)."""
    import torch

    from gdn_kcp.demo.byte_lm import ByteLM

    torch.manual_seed(0)
    model = ByteLM(layer).double()
    prompt = b"def main():\n    return "
    text, seconds = model.generate(prompt, 12)
    assert len(text) == 12 and seconds > 0 and model.training
    tokens = torch.tensor(list(prompt + text))
    with torch.no_grad():
        logits = model.eval()(tokens)
    assert bytes(logits[len(prompt) - 1:-1].argmax(-1).tolist()) == text
