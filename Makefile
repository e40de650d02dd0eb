# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv on first use (`make setup`:
# tools/setup_venv.py, whose docstring lists its steps; docs/install.md says what it installs and keeps, and why).
PYTHON ?= python3
VENV   ?= .venv
STACK  ?= auto
PY     := $(VENV)/bin/python
EXTRAS ?= mpi,test
STAMP  := $(VENV)/.installed
# One torch JIT extension cache per venv (DeepSpeed's CPU shm op): torch's default ~/.cache/torch_extensions is shared
# by every checkout, each of which rebuilds the op (40-50 s) when another built it last. A value you set wins.
export TORCH_EXTENSIONS_DIR ?= $(or $(realpath $(VENV)),$(abspath $(VENV)))/torch_extensions
# Set-up ends by building DeepSpeed's ops the runs load into that cache; BUILD_OPS=0 leaves them to the first run.
BUILD_OPS ?= 1
# Offline install (docs/install.md): `make setup WHEELHOUSE=dir` installs from dir alone (built by `make wheelhouse`).
WHEELHOUSE ?=
PY_VER   ?= 3.12
PLATFORM ?= manylinux_2_28_x86_64
BASE     ?= tools/base/cuda_image.txt
WHEELS   ?= wheelhouse
# a size cap the user sets for the wheelhouse (MB; 0: none): its size depends on BASE (an image holding only torch
# needs every other requirement), so no fixed cap fits every target
WHEELHOUSE_MAX_MB ?= 0

.PHONY: setup demo test test-fast test-stack bytecode gaudi-image gaudi-setup test-gaudi test-ds-unit lint bench clean wheelhouse gpu-check

setup: $(STAMP)

$(STAMP): pyproject.toml $(wildcard stacks/*.txt)
	$(PYTHON) tools/setup_venv.py --venv $(VENV) --stack $(STACK) --extras $(EXTRAS) --build_ops $(BUILD_OPS)$(if \
	  $(WHEELHOUSE), --wheelhouse $(WHEELHOUSE))

demo: $(STAMP)
	$(PY) -m bert_ref.demo --out demo_out
	$(PY) -m bridgetower_ds.demo --out demo_out/bridgetower

# ruff (pyproject.toml [tool.ruff]) first: a second to run, and CI fails on a lint error as on a test; pytest
# prints the 10 slowest tests at the end (where the suite's time goes)
test: lint
	$(PY) -m pytest -q --durations=10 tests

lint: $(STAMP)
	$(PY) -m ruff check .

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

# the tests every stack of the support matrix runs (marker `stack`: every command's engine path, the speed-ups and
# library differences decided by feature); `make test` runs them too, with everything else. STACK_TESTS: the marker
# expression; CI's Gaudi lanes other than the fork's own give `stack and each_gaudi` (pyproject.toml's markers)
STACK_TESTS ?= stack
test-stack: bytecode
	$(PY) -m pytest -q --durations=10 -m "$(STACK_TESTS)" tests

# A Gaudi lane (docs/gaudi.md), as a Gaudi user installs: a venv that plays the image's Python (GAUDI_IMAGE: the
# `# image` packages of stacks/gaudi-$(GAUDI).txt on the stack's Python version, DeepSpeed from Habana's fork at
# HABANA_DS, its source tree or release archive; reused while neither changed), `make setup PYTHON=<it>`
# into GAUDI_VENV (it keeps the image's torch, DeepSpeed and transformers), then `make test-stack` there. GAUDI: the
# Intel Gaudi software release (1.23: Gaudi 2/3; 1.21: the last for first-gen Gaudi, AWS DL1):
#   make test-gaudi GAUDI=1.21 HABANA_DS=path/to/habana-deepspeed-1.21.0.tar.gz
HABANA_DS   ?=
GAUDI       ?= 1.23
GAUDI_IMAGE ?= .gaudi-image-$(GAUDI)
GAUDI_VENV  ?= .venv-gaudi-$(GAUDI)
# the image venv alone (reused while the stack's image pins and the fork are unchanged)
gaudi-image:
	@test -n "$(HABANA_DS)" || { echo "make $@: set HABANA_DS to Habana's DeepSpeed fork (its source tree or release archive, e.g. habana-deepspeed-1.21.0.tar.gz)" >&2; exit 2; }
	@test -f stacks/gaudi-$(GAUDI).txt || { echo "make $@: GAUDI=$(GAUDI): no stacks/gaudi-$(GAUDI).txt (tested releases: $$(ls stacks | sed -n 's/^gaudi-\(.*\)\.txt$$/\1/p' | tr '\n' ' '))" >&2; exit 2; }
	$(PYTHON) tools/stacks.py image --stack gaudi-$(GAUDI) --fork "$(HABANA_DS)" --venv $(GAUDI_IMAGE)
GAUDI_ARGS   = PYTHON=$(abspath $(GAUDI_IMAGE))/bin/python VENV=$(GAUDI_VENV) STACK=gaudi-$(GAUDI) EXTRAS=$(EXTRAS) \
	       TORCH_EXTENSIONS_DIR=$(abspath $(GAUDI_VENV))/torch_extensions
# the lane's set-up alone: the image venv, then `make setup` from it
gaudi-setup: gaudi-image
	$(MAKE) setup $(GAUDI_ARGS)
test-gaudi: gaudi-setup
	$(MAKE) test-stack $(GAUDI_ARGS)

# DeepSpeed's own unit tests, a subset reaching every change the toolkit makes inside DeepSpeed, run with the changes
# on and off, every outcome compared test by test (tools/ds_unit_tests.py, docs/development.md); the tests archive of
# the installed DeepSpeed comes from DS_TESTS (the archive or its folder), else shared/third_party/ beside the checkout
DS_TESTS ?=
test-ds-unit: $(STAMP)
	$(PY) tools/ds_unit_tests.py $(if $(DS_TESTS),--tests "$(DS_TESTS)")

bench: $(STAMP)
	$(PY) -m bench.h5_loader
	$(PY) -m bench.bert_step
	$(PY) -m bench.image_pipeline
	$(PY) -m bench.zero_memory
	$(PY) -m bench.phase_overhead
	$(PY) -m bench.startup
	$(PY) -m bench.host_ops --presets bert_large,bert_1p5b,bridgetower_large --settings after --layers 1

# every wheel the toolkit needs beyond BASE (the packages the target already has), for Python PY_VER on PLATFORM, at
# the versions of the stack the target's set-up installs with (STACK; auto builds latest's: for a Gaudi image's
# cluster, STACK=gaudi-1.23 (or gaudi-1.21) with a BASE of the image's packages);
# DeepSpeed built here from its sdist (needs this machine's venv: pip, packaging, torch for DeepSpeed's setup.py).
# `make wheelhouse PY=3.12 PLATFORM=manylinux_2_28_x86_64`: on this target PY names the target's Python version.
wheelhouse:
	@test -x $(VENV)/bin/python || { echo "make wheelhouse: run 'make setup' first (it needs $(VENV))" >&2; exit 1; }
	$(VENV)/bin/python tools/wheelhouse.py --out $(WHEELS) --python $(or $(filter 3.%,$(PY)),$(PY_VER)) \
	  --platform $(PLATFORM) --base $(BASE) --extras $(EXTRAS) --max_mb $(WHEELHOUSE_MAX_MB) \
	  --constraints stacks/$(if $(filter auto,$(STACK)),latest,$(STACK)).txt

# the whole CUDA check (bench/gpu_check.py), planned into GPU_CHECK_BUDGET seconds counted from make's start (the
# install included), most valuable part first; on a CPU-only machine the same
# plumbing with debug models (--cpu_smoke). GPU_CHECK_ARGS="--part bert_large" runs one part. Results: gpu_check_out/
GPU_CHECK_BUDGET ?= 480
GPU_CHECK_T0 := $(shell date +%s)
# gpu-check's budget counts set-up: its set-up leaves the op builds to the parts whose runs load them, so that a part
# the budget skips has not paid for a build it never used (target-specific, so the $(STAMP) it makes sees it too)
gpu-check: BUILD_OPS = 0
gpu-check: $(STAMP)
	$(PY) -m bench.gpu_check --budget $(GPU_CHECK_BUDGET) --started_at $(GPU_CHECK_T0) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .venv-gaudi-* .gaudi-image-* demo_out runs .pytest_cache
