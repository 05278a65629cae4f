# kvcache: the package and its executable book.
#   make book     build the website into _build/html (warnings are errors)
#   make test     build the book, then run every test and re-execute every chapter (nbval)
#   make refresh  re-execute every chapter in place (after changing the package)
#   make setup    install system tools and the .venv (the targets above do it first)
#   make clean    remove the build and caches (keeps .venv; `make distclean` removes it too)

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

# Chapters run on the CPU through Triton's interpreter; the kernel picks the env up.
# JUPYTER_PREFER_ENV_PATH: the "python3" kernel is the .venv's, whatever ~/.local holds.
# PYTHONHASHSEED: set/dict orders of strings are the same in every run.
RUN_ENV := TRITON_INTERPRET=1 JUPYTER_PREFER_ENV_PATH=1 PYTHONHASHSEED=0
# Every check a caller can trigger must survive `python -O`, which strips asserts.
OPT_TESTS := tests/test_misuse.py tests/test_mha_pool.py tests/test_store_cache.py \
             tests/test_distributed.py tests/test_block_manager.py tests/test_flow_stateful.py
NBVAL_FLAGS := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
               --nbval-cell-timeout=1200

.PHONY: help setup system-deps book test refresh clean distclean

help:
	@sed -n '2,7p' Makefile | sed 's/^# \{0,1\}//'

# --------------------------------------------------------------------------- set-up
setup: system-deps $(STAMP)

# graphviz's `dot` draws the radix trees; Chromium runs the website test (tests/test_site.py).
system-deps:
	@missing=""; \
	command -v dot >/dev/null 2>&1 || missing="$$missing graphviz"; \
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
book: setup
	$(PY) scripts/check_notebooks.py
	rm -rf _build/html _build/.doctrees
	$(VENV)/bin/jupyter-book build . --builder html --warningiserror --keep-going

refresh: setup
	@if [ -z "$(NOTEBOOKS)" ]; then echo "no chapters in book/ yet"; fi
	@for nb in $(NOTEBOOKS); do \
	  echo "executing $$nb"; \
	  $(RUN_ENV) $(VENV)/bin/jupyter execute --inplace --kernel_name=python3 "$$nb"; \
	done

# --------------------------------------------------------------------------- tests
# Package tests (and the website test on the book just built), then every chapter under
# nbval. Both always run; the target fails if either failed.
test: setup book
	@rc=0; \
	$(RUN_ENV) $(PY) -m pytest tests || rc=$$?; \
	echo "misuse checks again under python -O (asserts stripped)"; \
	$(RUN_ENV) $(PY) -O -m pytest -q -p no:cacheprovider $(OPT_TESTS) || rc=$$?; \
	if [ -n "$(NOTEBOOKS)" ]; then \
	  $(RUN_ENV) $(PY) -m pytest $(NBVAL_FLAGS) $(NOTEBOOKS) || rc=$$?; \
	else \
	  echo "no chapters in book/ yet: nothing for nbval"; \
	fi; \
	exit $$rc

# --------------------------------------------------------------------------- cleaning
clean:
	rm -rf _build .pytest_cache .hypothesis build *.egg-info
	find . -path ./$(VENV) -prune -o -type d \( -name __pycache__ -o -name .ipynb_checkpoints \) -print0 | xargs -0 -r rm -rf

distclean: clean
	rm -rf $(VENV)
