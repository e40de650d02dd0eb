# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv on first use.
# torch is installed (torch==2.13.0, the CPU build here) only when no torch is importable: on a Gaudi or GPU machine
# the venv is made with --system-site-packages so it sees the torch that is already installed and keeps it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
EXTRAS ?= mpi,test
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-fast bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	    echo "[setup] torch found in $(PYTHON): creating $(VENV) with --system-site-packages to keep it"; \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi
	$(PIP) install -q --upgrade pip
	@if ! $(PY) -c "import torch" >/dev/null 2>&1; then \
	  echo "[setup] no torch importable: installing torch==2.13.0"; \
	  $(PIP) install -q torch==2.13.0; \
	else \
	  echo "[setup] keeping installed torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	fi
	$(PIP) install -q -e ".[$(EXTRAS)]"
	@if $(PY) -c "import habana_frameworks" >/dev/null 2>&1; then $(PIP) install -q -e ".[hpu]"; fi
	$(PY) -c "import ds_core, ds_tools, bert_ref, bridgetower_ds, launch; print('[setup] ok')"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m bert_ref.demo --out demo_out

test: $(STAMP)
	$(PY) -m pytest -q --durations=25 tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

bench: $(STAMP)
	$(PY) -m bench.h5_loader
	$(PY) -m bench.bert_step
	$(PY) -m bench.image_pipeline
	$(PY) -m bench.zero_memory
	$(PY) -m bench.startup

clean:
	rm -rf $(VENV) demo_out runs .pytest_cache
