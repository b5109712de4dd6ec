# Everything a fresh machine needs, in two commands:
#   make demo   set up, then run the flagship notebook end to end (offline tiny model without a GPU)
#   make test   set up, then run the test suite (what CI runs)
# Set-up makes .venv/ and installs torch first (the CPU build where there is no GPU, so pip never
# pulls gigabytes of CUDA wheels), then nbkit with its test extras at the versions CI pins.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CI on hosted runners points this at the PyTorch CPU index; locally the default index is fine.
TORCH_INDEX ?=
DEMO_OUT ?= notebooks/outputs

.PHONY: setup lint test demo clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" $(TORCH_INDEX)
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $@

setup: $(VENV)/.installed

# ruff (lint + format) over the whole tree; mypy over the package (config in pyproject.toml).
lint: setup
	$(VENV)/bin/ruff check nbkit tests benchmarks notebooks/run.py
	$(VENV)/bin/ruff format --check nbkit tests benchmarks notebooks/run.py

test: lint
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

demo: setup
	mkdir -p $(DEMO_OUT)
	HF_HUB_OFFLINE=1 $(PY) notebooks/run.py qwen3_vl_2xT4 --out $(DEMO_OUT)

clean:
	rm -rf $(VENV) $(DEMO_OUT)

# ---- The browser test (tests/test_browser.py), kept apart from the set-up above -----------------
# Debian's chromium (root or a CI image that has it; Playwright's own browser download is not used)
# and the `browser` extra (playwright, jupyterlab, notebook). `make test` runs it, as CI must;
# screenshots go to $(NBKIT_BROWSER_ARTIFACTS) (CI: keep that directory as an artifact).
NBKIT_BROWSER_ARTIFACTS ?= artifacts/browser
export NBKIT_BROWSER_ARTIFACTS

$(VENV)/.browser: $(VENV)/.installed pyproject.toml constraints.txt
	command -v chromium >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q chromium; }
	$(PY) -m pip install -q -c constraints.txt -e ".[browser]"
	touch $@

.PHONY: browser-setup
browser-setup: $(VENV)/.browser
test: browser-setup
