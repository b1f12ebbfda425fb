#!/usr/bin/env bash
# The GPU check, offline, on the machine's torch and triton: every stage of
# benchmarks/gpu_check.py in a process of its own under its own cap (the whole
# run at most 9 minutes; --quick: correctness, the calibration rows and the
# capture in 4). Results go to $OUT (default benchmarks/out): gpu_check.json
# and gpu_check.md, and stages/<stage>.log.
#
# No registry is needed. Wheels in .whl/ (flash-linear-attention's fla-core for
# the side-by-side rows, say) are installed to a private folder first; fill it
# where a registry is reachable:
#     pip download --no-deps fla-core==0.5.1 -d .whl
# and for the cute stage (the CuTe DSL programs; without them it reports "skipped"):
#     pip download --no-deps nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
#         nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu12==4.8.1 cuda-bindings cuda-pathfinder -d .whl
# gdn_kcp goes on the path as a package (kernels/ as gdn_kcp/kernels).
#
#     bash benchmarks/gpu_check.sh            # make gpu-check
#     bash benchmarks/gpu_check.sh --quick
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
# the DSL's modules live under its package, put on the path by a .pth file that a --target folder does not run
if [ -d "$SITE/nvidia_cutlass_dsl/dsl_packages" ]; then
    export PYTHONPATH="$SITE/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
fi
export TRITON_INTERPRET=0 TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# gpu_check.py keeps to its own budget (450 s, --quick 230 s); this cap is the last resort.
timeout 535 python3 benchmarks/gpu_check.py --out "$OUT" "$@"
