# The two commands of the quick start: `make demo` and `make test`.
# Each creates .venv and installs what it needs. With no torch in the venv,
# torch==2.13.0 is preferred (a CPU build where a local file offers it, so a CPU
# machine does not download a CUDA build); any torch>=2.11 is accepted.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test bench-cpu mutate mutate-numeric compile-check compile-report roofline gpu-check clean

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

test: $(VENV)/.test
	$(PY) -m pytest

bench-cpu: $(VENV)/.base
	$(PY) benchmarks/cpu_chunk.py

# Not CI: every Triton kernel compiled for sm_90 and sm_100, shared memory per kernel.
compile-check: $(VENV)/.test
	GDN_KCP_COMPILE_SM100=1 $(PY) -m pytest -s tests/test_triton_compile.py

# Not CI: registers, spills and tensor-core use of every kernel for sm_90 (ptxas log and PTX; minutes).
compile-report: $(VENV)/.test
	TRITON_INTERPRET=0 TRITON_DEFAULT_FP_FUSION=1 TRITON_CACHE_DIR=$$(mktemp -d) $(PY) -m gdn_kcp.kernels.triton.compile_specs --report

# Not CI: static H200 estimate of one forward+backward, ours and FLA's (compiles every kernel for sm_90; minutes).
# FLA_SITE=DIR adds fla-core from a `pip install --target DIR` (else FLA is included when `fla` imports).
roofline: $(VENV)/.test
	TRITON_INTERPRET=0 TRITON_DEFAULT_FP_FUSION=1 TRITON_CACHE_DIR=$$(mktemp -d) $(PY) benchmarks/roofline.py $(if $(FLA_SITE),--fla $(FLA_SITE))

# On a GPU machine only (uses the machine's torch and triton).
gpu-check:
	bash benchmarks/gpu_check.sh

# Not CI: every term of the byte queries mutated in turn must fail a test (tens of minutes).
mutate: $(VENV)/.test
	$(PY) tools/mutate_queries.py

# Not CI: a fixed-seed sample of operator-level mutants of the programs, host path, exchanges and
# layers, each run against the tests of its file (about an hour on 2 cores).
mutate-numeric: $(VENV)/.test
	$(PY) tools/mutate_numeric.py

clean:
	rm -rf $(VENV) *.egg-info
