# Two commands do all the set-up (see README):
#   make demo   - create/reuse .venv, install nxd_lc, run the CPU demo (TP=2 + sequence parallel, 2 processes)
#   make test   - create/reuse .venv, install nxd_lc[dev], run the whole test suite
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip install -q -c constraints.txt
DEPS    := pyproject.toml constraints.txt

.PHONY: demo test install install-dev lint clean-runs

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(PY) $(DEPS)
	$(PIP) -e .
	touch $@

$(VENV)/.installed-dev: $(PY) $(DEPS)
	$(PIP) -e '.[dev]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=2 train.py --config-name cpu_tiny_llama_config

test: install-dev
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -rs tests

lint: install-dev
	$(VENV)/bin/ruff check nxd_lc tests train.py

clean-runs:
	rm -rf nxd_lc_runs
