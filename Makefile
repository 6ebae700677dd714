# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install, train on the generated demo data (2 CPU processes)
#   make test   - create .venv, install, lint (ruff check .), run the test suite
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python

.PHONY: demo lint test bench figures clean

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

test: lint
	$(PY) -m pytest -q --durations=15

bench: $(VENV)/.installed
	$(PY) -m benchmarks

# docs/how-it-works.md's figures and numbers, from real CPU training runs (minutes on 2 cores).
figures: $(VENV)/.installed
	$(PY) -m benchmarks.figures

clean:
	rm -rf runs .pytest_cache
