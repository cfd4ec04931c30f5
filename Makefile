# Two commands a newcomer needs (README): `make demo` and `make test`.
# Each creates .venv if needed, installs what it needs, and runs.
PYTHON ?= python3
VENV ?= .venv
# CI and the CPU dev box take the CPU wheel on local disk. On a GPU machine:
#   make demo TORCH_SPEC="torch" (or pre-install your CUDA torch into .venv first).
TORCH_SPEC ?= torch==2.13.0
PIP = $(VENV)/bin/python -m pip
CONSTRAINTS = -c constraints.txt

.PHONY: demo test lint bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.torch: | $(VENV)/bin/python
	$(PIP) install -q "$(TORCH_SPEC)"
	touch $@

# the README's install line: the package with its `all` extra
$(VENV)/.demo: pyproject.toml constraints.txt $(VENV)/.torch
	$(PIP) install -q $(CONSTRAINTS) -e ".[all]"
	touch $@

$(VENV)/.dev: pyproject.toml constraints.txt $(VENV)/.torch
	$(PIP) install -q $(CONSTRAINTS) -e ".[dev]"
	touch $@ $(VENV)/.demo

# --overwrite: the demo's own demo_output, replaced by each run (train refuses a non-empty one)
demo: $(VENV)/.demo
	$(VENV)/bin/hf-memkit train recipes/tiny-llama/1m_full_cpu.yaml --overwrite

# every extra is installed here, so a missing one (or missing published GPU anchors,
# docs/anchors.md) fails instead of skipping
test: $(VENV)/.dev
	HF_MEMKIT_STRICT_TESTS=1 $(VENV)/bin/python -m pytest -q

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check hf_memkit tests bench

clean:
	rm -rf $(VENV) demo_output .pytest_cache
