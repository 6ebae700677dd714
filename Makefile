# Each of these does all set-up on a fresh machine (creates .venv and installs):
#   make demo     - train on the generated demo data (2 CPU processes)
#   make test     - lint (ruff check .), then the tests not marked full: every in-process test
#                   and a few 2-process runs (DDP, a stop and its exact continuation, the recipe);
#                   under 4 minutes on 2 otherwise idle cores (docs/tests.md)
#   make test-all - lint, then every test (what CI runs: .ci/run)
# On a machine with one CUDA GPU (and torch in $(PY); make bench-gpu PY=python to use another):
#   make bench-gpu - the GPU checks, then --decode workers against device (benchmarks/decode.py)
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python

.PHONY: demo lint test test-all bench bench-gpu figures clean

$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

# --resume none: each demo starts afresh (an earlier demo run is moved to runs/demo/previous-runs/).
demo: $(VENV)/.installed
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=2 train_multi_gpu_using_launch.py \
		--device cpu --model resnet18 --img-size 64 --batch-size 16 --lr 0.005 --epochs 6 \
		--output-dir runs/demo --resume none --keep-last 1

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

# The tiers: pytest.ini's markers, tests/conftest.py's pytest_collection_modifyitems.
test: lint
	$(PY) -m pytest -q --durations=15 -m "not full"

test-all: lint
	$(PY) -m pytest -q --durations=15

bench: $(VENV)/.installed
	$(PY) -m benchmarks

# Under 8 minutes on one H100/H200 (no network needed): the tests that need a GPU, then the
# decode stage at the target's sizes (ResNet34, 224 px, batch 256, bf16, channels-last), its
# table and figures in benchmark_results/gpu/benchmark.json. Without CUDA: one error line.
GPU_BENCH = --device cuda --stages loop decode --img-size 224 --batch-size 256 --steps 15 \
	--warmup-steps 5 --repeats 3 --pipeline-images 256 --output-dir benchmark_results/gpu
bench-gpu:
	$(if $(filter True,$(shell $(PY) -c "import torch; print(torch.cuda.is_available())" \
		2>/dev/null)),,$(error make bench-gpu needs a CUDA GPU and torch in $(PY) (or make \
		bench-gpu PY=python), but torch.cuda.is_available() is not True there))
	$(PY) -m pytest -q -p no:cacheprovider tests/test_loader_and_prefetch.py \
		tests/test_device_decode.py -k gpu
	$(PY) -m benchmarks $(GPU_BENCH)

# docs/how-it-works.md's figures and numbers, from real CPU training runs (minutes on 2 cores).
figures: $(VENV)/.installed
	$(PY) -m benchmarks.figures

clean:
	rm -rf runs .pytest_cache
