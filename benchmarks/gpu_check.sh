#!/usr/bin/env bash
# One script for a GPU machine (finishes in under 8 minutes on an H200):
# correctness of every Triton program and of forward+backward against the torch
# programs at T = 32768, H_qk = 16, HV = 32, K = V = 128, bf16; forward and
# forward+backward times; the same for flash-linear-attention when it imports;
# a torch.compile(mode="reduce-overhead") run; the walk times over intra-rank
# segments P (at HV = 32 and HV = 4, P = 1, the plan's P, 2, 4, 8); the layer's decode at FLA's head
# sizes (K = 256, V = 512), against FLA's layer with the same state dict when flash-linear-attention's
# layers import (its wheel and transformers' in .whl/). Results go to $OUT (default
# benchmarks/out): gpu_check.json and gpu_check.md.
#
# Uses the machine's torch and triton. Wheels in .whl/ (fla-core, say) are
# installed to a private target first. gdn_kcp is put on the path as a package
# (kernels/ as gdn_kcp/kernels), so nothing needs a network.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/out}"
mkdir -p "$OUT"
SITE="$(mktemp -d)"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl
fi
cp -r gdn_kcp "$SITE/gdn_kcp"
cp -r kernels "$SITE/gdn_kcp/kernels"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0 TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 470 python3 benchmarks/gpu_check.py --out "$OUT" "$@"
