# kvcache: the package and its executable book.
#   make book     build the website into _build/html, its Chinese edition into _build/html/zh
#   make catalogs after an English edit: extract the text and update locale/'s catalogs
#   make test     build the book, lint, run every test and re-execute every chapter (nbval)
#   make refresh  re-execute every chapter in place (after changing the package)
#   make lab      open the chapters in JupyterLab (the venv's python3 kernel, live widgets)
#   make lint     ruff (lint + format check) over the code and chapters, mypy --strict on kvcache/
#   make setup    install system tools and the .venv (the targets above do it first)
#   make clean    remove the build and caches (keeps .venv; `make distclean` removes it too)
#   make gpu-record  on a CUDA machine: kernel benchmarks, GPU tests -> book/data/*_gpu_v2.json

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvcache-installed
# The CPU build of torch lies on disk here; pip takes it for torch==2.13.0.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
NOTEBOOKS  := $(sort $(wildcard book/*.ipynb))

# Triton's CPU interpreter (TRITON_INTERPRET=1) only where torch sees no CUDA device: on a GPU the
# kernels run for real (with the variable set, Triton would interpret CUDA launches too). Asked
# of the .venv's torch once, when a recipe first needs it; `make TRITON_INTERPRET=0|1` (or the
# environment) overrides it.
TRITON_INTERPRET ?= $(eval TRITON_INTERPRET := $$(shell $(PY) -c 'import torch; print(int(not torch.cuda.is_available()))' 2>/dev/null || echo 1))$(TRITON_INTERPRET)
# JUPYTER_PREFER_ENV_PATH: the "python3" kernel is the .venv's, whatever ~/.local holds.
# PYTHONHASHSEED: set/dict orders of strings are the same in every run.
RUN_ENV = TRITON_INTERPRET=$(TRITON_INTERPRET) JUPYTER_PREFER_ENV_PATH=1 PYTHONHASHSEED=0
# Every check a caller can trigger must survive `python -O`, which strips asserts. The package
# holds no assert and no __debug__ (tests/package/test_layers.py proves it on the source), so the
# refusal tests run again under -O as a witness, not the whole suite.
OPT_TESTS := tests/managers/test_misuse.py tests/serving/test_serving_misuse.py \
             tests/managers/test_registry.py tests/package/test_validate.py
XDIST ?= -n auto --dist loadfile
NBVAL_FLAGS := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
               --nbval-cell-timeout=1200

.PHONY: help setup system-deps book test refresh clean distclean gpu-record

help:
	@sed -n '2,11p' Makefile | sed 's/^# \{0,1\}//'

# --------------------------------------------------------------------------- set-up
setup: system-deps $(STAMP)

# graphviz's `dot` draws the radix trees, in the one font they name ("DejaVu Sans", which the
# website also serves: book/_static/fonts); Chromium runs the website tests (tests/book/),
# which lay out the Chinese edition's pages with a CJK font (WenQuanYi Micro Hei, 4 MB) as a
# reader's browser would with its own.
system-deps:
	@missing=""; \
	command -v dot >/dev/null 2>&1 || missing="$$missing graphviz"; \
	[ -n "$$(fc-list ':family=DejaVu Sans' family 2>/dev/null)" ] || missing="$$missing fonts-dejavu-core fontconfig"; \
	[ -n "$$(fc-list ':lang=zh-cn' family 2>/dev/null)" ] || missing="$$missing fonts-wqy-microhei"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	$(PYTHON) -c 'import ensurepip, venv' >/dev/null 2>&1 || missing="$$missing python3-venv"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  SUDO=""; [ "$$(id -u)" -eq 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq; \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y --no-install-recommends $$missing; \
	fi
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "kvcache needs Python >= 3.11; run make PYTHON=/path/to/python3.11")'

$(STAMP): pyproject.toml
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(FIND_LINKS) -e '.[triton,test,book]'
	@touch $@

# --------------------------------------------------------------------------- the book
# The English site, and at the same time (Sphinx reads on one core) the Chinese edition into
# _build/html/zh from the same sources and locale/'s catalogs (scripts/zh_book.py; its log is
# printed after the English one). Both with warnings as errors; either failing fails the target.
book: setup
	$(PY) scripts/check_notebooks.py
	rm -rf _build/html _build/.doctrees
	@mkdir -p _build; rc=0; \
	$(PY) scripts/zh_book.py html > _build/zh-book.log 2>&1 & zh=$$!; \
	echo "building the Chinese edition in the background (log: _build/zh-book.log)"; \
	$(VENV)/bin/jupyter-book build . --builder html --warningiserror --keep-going || rc=$$?; \
	wait $$zh || { rc=1; echo "the Chinese edition failed:"; }; \
	cat _build/zh-book.log; exit $$rc

# After an English edit: extract every page's text (gettext builder) and update the catalogs
# (sphinx-intl): a changed paragraph becomes fuzzy, a new one empty, and tests/book/test_zh_edition.py
# fails until each is translated (scripts/zh_translate.py dump/fill, or any PO editor).
.PHONY: catalogs
catalogs: setup
	$(PY) scripts/zh_book.py catalogs

refresh: setup
	@if [ -z "$(NOTEBOOKS)" ]; then echo "no chapters in book/ yet"; fi
	@for nb in $(NOTEBOOKS); do \
	  echo "executing $$nb"; \
	  $(RUN_ENV) $(VENV)/bin/jupyter execute --inplace --kernel_name=python3 "$$nb"; \
	done

# --------------------------------------------------------------------------- interactive
# JupyterLab (book extra) on the repository, opened at book/, with RUN_ENV: the "python3"
# kernel is the venv's and runs the chapters as `make refresh` does; ipywidgets' Lab extension
# makes the explorer live. Extra server options: make lab LAB_ARGS="--no-browser --port=8890".
# tests/book/test_jupyter.py starts the same server headless.
LAB_ARGS ?=
.PHONY: lab
lab: setup
	$(RUN_ENV) $(VENV)/bin/jupyter lab --ServerApp.root_dir="$(CURDIR)" \
	  --LabApp.default_url=/lab/tree/book $(if $(filter 0,$(shell id -u)),--allow-root,) $(LAB_ARGS)

# --------------------------------------------------------------------------- lint
# Rules and their reasons: [tool.ruff] and [tool.mypy] in pyproject.toml. All three run; the
# target fails if any failed. `ruff check --fix` and `ruff format` apply the fixable ones.
LINT_PATHS := kvcache tests benchmarks scripts book
.PHONY: lint
lint: setup
	@rc=0; \
	$(VENV)/bin/ruff check $(LINT_PATHS) || rc=$$?; \
	$(VENV)/bin/ruff format --check $(LINT_PATHS) || rc=$$?; \
	$(VENV)/bin/mypy || rc=$$?; \
	exit $$rc

# --------------------------------------------------------------------------- tests
# Lint and types (ruff, mypy), the package tests (and the website tests on the book just built),
# the misuse tests under python -O, then every chapter under nbval. All always run; the target
# fails if any failed. pytest-xdist runs whole files (a chapter is one file) on every core
# (`make test XDIST=` runs them in one process).
test: setup book
	@rc=0; \
	$(MAKE) --no-print-directory lint || rc=$$?; \
	$(RUN_ENV) $(PY) -m pytest $(XDIST) tests || rc=$$?; \
	echo "misuse checks again under python -O (asserts stripped)"; \
	$(RUN_ENV) $(PY) -O -m pytest -q -p no:cacheprovider $(XDIST) $(OPT_TESTS) || rc=$$?; \
	if [ -n "$(NOTEBOOKS)" ]; then \
	  $(RUN_ENV) $(PY) -m pytest $(XDIST) $(NBVAL_FLAGS) $(NOTEBOOKS) || rc=$$?; \
	else \
	  echo "no chapters in book/ yet: nothing for nbval"; \
	fi; \
	exit $$rc

# --------------------------------------------------------------------------- GPU record
# One prepared run on a CUDA machine (under five minutes on one GPU, each step under a timeout):
# the store, paged-decode and host-cost benchmarks, each writing device-labelled JSON (device,
# versions, date, commit, the copy bandwidth measured in the same run) beside the first record,
# as book/data/*_gpu_v2.json, which chapters 6 and 13 plot beside it; then the GPU tests
# (kernels compiled for the device, no interpreter). Without CUDA it says so and fails at once,
# before installing anything.
GPU_DATA := book/data
gpu-record:
	@command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 || \
	  { echo "make gpu-record needs a CUDA GPU: nvidia-smi sees none here; nothing recorded" >&2; exit 1; }
	@$(MAKE) --no-print-directory setup
	GPU_DATA=$(GPU_DATA) bash scripts/gpu_record.sh $(PY)

# --------------------------------------------------------------------------- cleaning
clean:
	rm -rf _build .pytest_cache .hypothesis build dist *.egg-info .ruff_cache .mypy_cache
	find . -path ./$(VENV) -prune -o -type d \( -name __pycache__ -o -name .ipynb_checkpoints \) -print0 | xargs -0 -r rm -rf

distclean: clean
	rm -rf $(VENV)
