# The two commands of the quick start: `make demo` and `make test`.
# Each creates .venv and installs what it needs. With no torch in the venv,
# torch==2.13.0 is preferred (a CPU build where a local file offers it, so a CPU
# machine does not download a CUDA build); any torch>=2.11 is accepted.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test test-extended precision bench-cpu mutate mutate-numeric compile-check compile-report lowering-check roofline roofline-facts sass-check fla-layer-check fla-kda-suite fla-gdn-suite gpu-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0 || $(PIP) install "torch>=2.11"
	touch $@

$(VENV)/.base: pyproject.toml $(VENV)/.torch
	$(PIP) install -e .
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.base
	$(PIP) install -e ".[test]"
	touch $@

demo: $(VENV)/.base
	$(PY) -m gdn_kcp demo

# Two workers, a test file each at a time (pytest-xdist), one OpenMP thread each: more threads than cores spin
# against each other (the GPU check's dry run took 182 s beside a two-thread load, 59 s with one thread).
test: $(VENV)/.test
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadfile

# The precision table (docs/testing.md): every output and gradient in fp16 and bf16 against GDN in fp64 on the
# same rounded inputs, on FLA's test_chunk grid and ours, with the tolerances and FLA's kernels' figures; then the
# Triton programs' rows held to docs/testing.md, which CI leaves out (about 10 minutes).
# Not CI: the cases marked `extended` (tests/conftest.py), each a kind CI already covers (the other exchange,
# more ranks, another dtype, FLA's V = 512 twin) kept out of `make test` to hold it under 20 minutes
# (about 6 minutes on 2 cores).
test-extended: $(VENV)/.test
	GDN_KCP_EXTENDED=1 OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadfile -m extended

precision: $(VENV)/.test
	$(PY) tests/precision_grid.py --triton
	GDN_KCP_PRECISION_TRITON=1 $(PY) -m pytest -q tests/test_precision_table.py -k triton_programs

bench-cpu: $(VENV)/.base
	$(PY) benchmarks/cpu_chunk.py

# Not CI: every Triton kernel compiled for sm_90 and sm_100, shared memory per kernel, and for sm_90 at
# (K, V) = (256, 256) and (128, 512) against the README's spill table (about 10 minutes).
compile-check: $(VENV)/.test
	GDN_KCP_COMPILE_SM100=1 GDN_KCP_COMPILE_LARGE=1 $(PY) -m pytest -s tests/test_triton_compile.py

# Not CI: two tests of tests/test_inductor_lowering.py compiled by Inductor on 2 gloo ranks: gdn_kcp with
# schedule="overlap", whose backward's output code issues b2, runs the walk's kernels, then waits (the order
# the graph's data forces); the layer under KCP, its halo exchange an ordered effect beside the others.
# Each equal to eager within 1e-12. About 7 minutes of C++ compile on 2 cores with an empty Inductor cache.
lowering-check: $(VENV)/.test
	GDN_KCP_LOWERING_INDUCTOR=1 $(PY) -m pytest --durations=0 tests/test_inductor_lowering.py \
	-k "overlaps_b2 or inductor_traces_the_layer"

# Not CI: registers, spills and tensor-core use of every kernel for sm_90 (ptxas log and PTX; minutes).
compile-report: $(VENV)/.test
	TRITON_INTERPRET=0 TRITON_DEFAULT_FP_FUSION=1 TRITON_CACHE_DIR=$$(mktemp -d) $(PY) -m gdn_kcp.kernels.triton.compile_specs --report

# Not CI: the calibrated H200 estimate of one forward+backward, ours and FLA 0.5.1's, from the committed
# compile facts (benchmarks/h200_facts.json; seconds). ARGS="--T 8192 --hv 8 --hq 2" for another shape.
roofline: $(VENV)/.test
	$(PY) benchmarks/roofline.py $(ARGS)

# Not CI: recompile every kernel of ours and every autotune configuration of FLA 0.5.1's for sm_90 with
# triton 3.6 (the GPU machine's; FLA 0.5.1 does not compile on 3.9) into benchmarks/h200_facts.json.
# Downloads fla-core 0.5.1 (with einops, which its GLA output kernel's module imports: KDA's rows) and triton 3.6.0
# into a temporary folder; about 10 minutes on 2 cores.
roofline-facts: $(VENV)/.test
	D=$$(mktemp -d) && $(PIP) install -q --no-deps --target $$D/fla fla-core==0.5.1 einops==0.8.2 \
	&& $(PIP) install -q --no-deps --target $$D/triton triton==3.6.0 \
	&& TRITON_INTERPRET=0 TRITON_DEFAULT_FP_FUSION=1 TRITON_CACHE_DIR=$$D/cache \
	$(PY) benchmarks/roofline.py --refresh-facts --fla-site $$D/fla --triton-site $$D/triton --calibration

# Not CI: the KDA counts the model prices from compiled code (benchmarks/kda_counts.py: SASS, FLA_SASS) against
# what tools/sass_counts.py reads off the sm_90 SASS of triton 3.6 now, ours and FLA 0.5.1's intra kernels (FLA's
# compile under 3.6 only). Downloads fla-core 0.5.1, einops, triton 3.6.0 and a numpy 3.6's interpreter runs with
# into a temporary folder; under a minute.
sass-check: $(VENV)/.test
	D=$$(mktemp -d) && $(PIP) install -q --no-deps --target $$D fla-core==0.5.1 einops==0.8.2 triton==3.6.0 \
	"numpy<2.4" && GDN_KCP_FLA_SITE=$$D PYTHONPATH=$$D OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:xdist \
	tests/test_triton_compile.py -k "kda_counts"

# Not CI: flash-linear-attention's own op tests on the CPU with ours swapped in (tools/fla_swap.py), FLA's torch
# references the oracle, no expected failure: fla-kda-suite runs tests/ops/test_kda.py against our chunk_kda and
# fused_recurrent_kda, fla-gdn-suite tests/ops/test_gdn.py and test_gdn_kernels.py against our
# chunk_gated_delta_rule and fused_recurrent_gated_delta_rule. FLA's tests are not in its package: FLA_TESTS is the
# tests/ops folder of a checkout of FLA (offline), else the files are downloaded at the commit read here.
# fla-core 0.6.0 and einops come from the package index into a temporary folder (docs/testing.md has the counts).
FLA_TESTS_URL = https://raw.githubusercontent.com/fla-org/flash-linear-attention/bc3b101dcb713ddc5bd8924b66754eb68b5ccf89/tests/ops
fla_suite = D=$$(mktemp -d) && $(PIP) install -q --no-deps --target $$D fla-core==0.6.0 einops==0.8.2 \
	&& for f in $(2); do if [ -n "$(FLA_TESTS)" ]; then cp "$(FLA_TESTS)/$$f" $$D/; \
	else curl -sSfL -o $$D/$$f $(FLA_TESTS_URL)/$$f; fi || exit 1; done \
	&& cd $$D && env -u FLA_CI_ENV FLA_SWAP_SUITE=$(1) PYTHONPATH=$$D:$(CURDIR)/tools OMP_NUM_THREADS=1 \
	$(abspath $(PY)) -m pytest -p fla_swap -q -rfEXs -p no:cacheprovider -W ignore::DeprecationWarning $(2)

fla-kda-suite: $(VENV)/.test
	$(call fla_suite,kda,test_kda.py)

fla-gdn-suite: $(VENV)/.test
	$(call fla_suite,gdn,test_gdn.py test_gdn_kernels.py)

# Not CI: flash-linear-attention 0.5.1's own GatedDeltaNet layer (its Triton kernels under triton 3.6's
# interpreter) against ours with the same state dict: training forward and gradients, cu_seqlens, padding
# masks, cached generation. Downloads FLA, einops and triton 3.6.0 into a temporary folder (a few minutes).
fla-layer-check: $(VENV)/.test
	D=$$(mktemp -d) && $(PIP) install -q --no-deps --target $$D fla-core==0.5.1 flash-linear-attention==0.5.1 \
	einops==0.8.2 triton==3.6.0 && GDN_KCP_FLA_SITE=$$D $(PY) -m pytest -q -s tests/test_fla_layer.py

# On a GPU machine only (uses the machine's torch and triton; offline, wheels from .whl/): at most 8 minutes,
# ARGS=--quick 4 (correctness, calibration rows, capture). Writes benchmarks/out/gpu_check.{json,md}.
gpu-check:
	bash benchmarks/gpu_check.sh $(ARGS)

# Not CI: every term of the byte queries mutated in turn must fail a test (tens of minutes).
mutate: $(VENV)/.test
	$(PY) tools/mutate_queries.py

# Not CI: a fixed-seed sample of operator-level mutants of the programs, host path, exchanges and
# layers, each run against the tests of its file (about an hour on 2 cores).
mutate-numeric: $(VENV)/.test
	$(PY) tools/mutate_numeric.py

clean:
	rm -rf $(VENV) *.egg-info
