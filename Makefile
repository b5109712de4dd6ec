# Everything a fresh machine needs, in two commands:
#   make demo          set up, then run the flagship notebook end to end (offline, a tiny model, without a GPU)
#   make test          set up, then lint and run the test suite on the newest supported set (constraints.txt);
#                      it is `make lint suite`, which CI runs side by side
# and what CI adds (bash .ci/run runs them):
#   make test-kaggle   the flagship notebook's test on the Kaggle image's set (constraints-kaggle.txt, .kaggle-site/)
#   make test-oldest   the same test command on the oldest supported set (constraints-oldest.txt, .venv-oldest/)
#   make dist          build the sdist and wheel into dist/ and check them with twine
# and, by hand, where pip reaches the package index:
#   make constraints   rewrite constraints.txt with what pip resolves today, and the other sets' shared pins with it
# Set-up makes the virtual environment and installs torch first (the CPU build where there is no GPU,
# so pip never pulls gigabytes of CUDA wheels), then nbkit with its test extras at the pinned versions.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
OLDEST := .venv-oldest
# CI on hosted runners points this at the PyTorch CPU index; locally the default index is fine.
TORCH_INDEX ?=
DEMO_OUT ?= notebooks/outputs
# Without a GPU the demo runs offline (tiny models, synthetic data: nothing to download); DEMO_HUB=1 lets it reach
# the hub there too. With a GPU it may: notebooks/run.py asks the hub and uses random weights where it does not answer.
DEMO_HUB ?= $(if $(shell command -v nvidia-smi),1,0)
# Which tests `make test-oldest` runs: all but the browser test, which checks the dashboard's HTML in
# JupyterLab and Notebook 7 (nothing there depends on the transformers / trl line) and runs on the newest set,
# and the tests marked version_independent: nbkit's own process handling where only torch and the notebook stack
# run (both sets share them): live sets and their faults, stop() on plain processes, the exported script of a
# torch-only cell under torchrun, an install into an environment of its own; and the checks of nbkit's own logic
# that need none of those libraries (the dashboard, options and config, export, patching, platform detection, the
# import structure). Their processes import none of the libraries the two sets differ in, so a second run repeated
# the same code (tests/conftest.py fails a marked test that imports one). A forked or spawned launch is never one: it
# starts through accelerate's notebook_launcher, whose version differs. 40 such tests took 340 s of the oldest set's
# 908 s on 2 shared cores (2026-11-25), which had pushed CI past 30 minutes. They are 211 now: each module of this
# set run alone on the oldest set, with the recorder in every process from its start and reads of those libraries'
# metadata noted too, found 151 more among the rest, 15 s of the set's test durations (the set took 632 s before
# them and 593 s after, 2026-11-29 on 2 cores: most of that difference is the box's variance). Nor the end-to-end
# runs of the benchmark harness (benchmarks/): a tool of ours, run on GPU hosts with the newest set (with the oldest
# only in gpu_suite.sh's SUITE_SET=oldest parts, where a failure shows in its own log), not code a user runs: ~100 s
# of the CPU. (test_host_cost_cpu stays: it also checks what nbkit's reporting patches read per step under each trl.)
HARNESS_ARGS := $(addprefix tests/,$(addsuffix .py,test_bench_cpu test_trainer_bench_cpu test_speed_suite_cpu))
HARNESS_IGNORES := $(HARNESS_ARGS:%=--ignore=%)
OLDEST_MARKS := -m "not gpu and not version_independent"
OLDEST_TESTS ?= --ignore=tests/test_browser.py $(HARNESS_IGNORES) $(OLDEST_MARKS)

# CI (.ci/run) runs parts of the suites side by side: the suite leaves ~40% of 2 cores idle while it waits on the
# processes, kernels and timeouts it starts (39% over tests/faults/test_live_stop.py, test_live.py and
# test_export.py, sampled from /proc/stat every 10 s, 2026-11-29). Beside the newest set's suite, at the lowest
# priority, run the harness's tests and, once the oldest set's environment is made, the oldest set's files and the
# Kaggle set's test: all but the fault tests (tests/faults) and the files that assert how long something took
# (OLDEST_TIMED), which a starved process would fail, and test_packaging.py, whose build writes nbkit_ddp.egg-info
# into the checkout as the newest set's build does. SUITE_SKIP and OLDEST_SKIP leave those out of the foreground
# runs; `make suite` and `make test-oldest` alone run everything. Measured in fresh-clone CIs on 2 cores: with the
# harness and the oldest set's three slowest files beside it, the suite took 1,198-1,266 s (1,200-1,224 s before,
# with the harness inside it) and CI 1,768 s (442ac9c); with ten of the oldest set's files and the Kaggle test
# beside it, the suite took 1,244 s, those ended ~10 minutes before it, and CI took 1,621 s (661efdd, 2026-11-30);
# with all of them beside it, the suite took 1,256 s, they ended ~8 minutes before it, and CI 1,586 s (a5ddb9d).
OLDEST_TIMED := $(addprefix tests/,$(addsuffix .py,test_fsdp_live test_launch test_supervisor test_reporting test_offline))
OLDEST_BESIDE := $(filter-out $(OLDEST_TIMED) tests/test_packaging.py tests/test_browser.py $(HARNESS_ARGS),\
	$(wildcard tests/test_*.py))
OLDEST_BESIDE_IGNORES := $(OLDEST_BESIDE:%=--ignore=%)
SUITE_SKIP ?=
OLDEST_SKIP ?=

# The Kaggle image's set: only its pins that differ from constraints.txt, installed without their dependencies into
# a folder first on the path of the newest set's environment (PYTHONPATH reaches the kernel, the live set's engines
# and the ranks), instead of a third environment: 13 s on 2 shared cores, where making an environment (a torch and
# ~100 packages) took 39-55 s. `make constraints` checks that pip resolves the two files together.
KAGGLE_SITE := .kaggle-site
KAGGLE_TESTS ?= "tests/test_notebooks.py::test_notebook_trains_saves_and_answers_on_cpu[qwen3_vl_2xT4]"

.PHONY: setup setup-oldest setup-kaggle lint suite test test-oldest test-kaggle test-harness test-oldest-beside dist demo clean constraints

# $(1): the environment's folder, $(2): the constraints file it is installed with. pip compiles every module to
# bytecode as it installs (16 of torch's and transformers' 21 s on 2 cores), and that must stay: where
# PYTHONDONTWRITEBYTECODE=1 is set (this project's CI machine), Python never writes bytecode itself, so without
# pip's every process compiled transformers, trl and torch again (9.6 s to import them instead of 4.5; the suite
# took 1,778 s instead of 1,067).
define make-venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q "torch==2.13.0" $(TORCH_INDEX)
	$(1)/bin/python -m pip install -q -c $(2) -e ".[test]"
	touch $(1)/.installed
endef

# $(1): the environment's folder, $(2): pytest arguments. One test command for every set; the slowest tests are
# listed at the end, so that a CI run that nears its 30 minutes says where they went.
define run-tests
	HF_HUB_OFFLINE=1 $(1)/bin/python -m pytest -q --durations=30 $(2)
endef

$(VENV)/.installed: pyproject.toml constraints.txt
	$(call make-venv,$(VENV),constraints.txt)

$(OLDEST)/.installed: pyproject.toml constraints-oldest.txt
	$(call make-venv,$(OLDEST),constraints-oldest.txt)

setup: $(VENV)/.installed

setup-oldest: $(OLDEST)/.installed

# pip check: the pins and the newest set's packages they land among must agree (a missed dependency would
# otherwise show as an odd failure in the notebook).
$(KAGGLE_SITE)/.installed: constraints-kaggle.txt $(VENV)/.installed
	rm -rf $(KAGGLE_SITE)
	$(PY) -m pip install -q --no-deps --target $(KAGGLE_SITE) -r constraints-kaggle.txt
	PYTHONPATH=$(CURDIR)/$(KAGGLE_SITE) $(PY) -m pip check
	touch $@

setup-kaggle: $(KAGGLE_SITE)/.installed

# ruff (lint + format) over the whole tree; mypy over the package and tools/ (config in pyproject.toml).
lint: setup
	$(VENV)/bin/ruff check nbkit tests benchmarks notebooks/run.py tools
	$(VENV)/bin/ruff format --check nbkit tests benchmarks notebooks/run.py tools
	$(VENV)/bin/mypy

test: lint suite

suite: setup
	$(call run-tests,$(VENV),$(SUITE_SKIP))

test-oldest: setup-oldest
	$(call run-tests,$(OLDEST),$(OLDEST_TESTS) $(OLDEST_SKIP))

test-harness: setup
	$(call run-tests,$(VENV),$(HARNESS_ARGS))

test-oldest-beside: setup-oldest
	$(call run-tests,$(OLDEST),$(OLDEST_MARKS) $(OLDEST_BESIDE))

test-kaggle: setup-kaggle
	PYTHONPATH=$(CURDIR)/$(KAGGLE_SITE) $(call run-tests,$(VENV),$(KAGGLE_TESTS))

# Not part of CI, which must not change with the package index: run it where pip reaches the index, with the
# Python CI uses (3.11), then read the changes (docs/versions.md).
constraints:
	$(PYTHON) tools/constraints.py

dist: setup
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(PY) -m twine check --strict dist/*

demo: setup
	mkdir -p $(DEMO_OUT)
	$(if $(filter 1,$(DEMO_HUB)),,HF_HUB_OFFLINE=1 )$(PY) notebooks/run.py qwen3_vl_2xT4 --out $(DEMO_OUT)

clean:
	rm -rf $(VENV) $(OLDEST) $(CLASSIC) $(KAGGLE_SITE) dist build $(DEMO_OUT) artifacts

# ---- The browser test (tests/test_browser.py), kept apart from the set-up above -----------------
# Debian's chromium (root or a CI image that has it; Playwright's own browser download is not used)
# and the `browser` extra (playwright, jupyterlab, notebook). `make test` (its suite) runs it, as CI must;
# screenshots go to $(NBKIT_BROWSER_ARTIFACTS) (CI: keep that directory as an artifact).
NBKIT_BROWSER_ARTIFACTS ?= artifacts/browser
export NBKIT_BROWSER_ARTIFACTS

$(VENV)/.browser: $(VENV)/.installed pyproject.toml constraints.txt
	command -v chromium >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q chromium; }
	$(PY) -m pip install -q -c constraints.txt -e ".[browser]"
	touch $@

# The classic Notebook 6.5 with ipywidgets 7.7.1 (Colab's), the browser test's third front end: an environment of
# its own, made of the notebook stack of that generation (constraints-classic.txt) and, after it, the test
# environment's libraries (a .pth file naming their folder: torch and the rest are not installed twice). The
# venv's own old setuptools goes: it would shadow the newer one torch needs.
CLASSIC := .venv-classic
site-packages = $$($(1) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

$(CLASSIC)/.installed: $(VENV)/.installed constraints-classic.txt
	rm -rf $(CLASSIC)
	$(PYTHON) -m venv $(CLASSIC)
	echo "$(call site-packages,$(PY))" > "$(call site-packages,$(CLASSIC)/bin/python)/zz_test_env.pth"
	$(CLASSIC)/bin/python -m pip uninstall -q -y setuptools
	$(CLASSIC)/bin/python -m pip install -q -c constraints-classic.txt notebook ipywidgets
	touch $@

.PHONY: browser-setup
browser-setup: $(VENV)/.browser $(CLASSIC)/.installed
suite: browser-setup
