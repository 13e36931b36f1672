# `make test`  : set up .venv (if absent) and run every test, in TEST_JOBS parallel workers.
# `make test-fast`: the unit tier without its slow tests (no process group, no subprocess, none of
#                the compile-heavy tests): the edit-test loop, about 40 s (1.5 min with empty caches).
# `make test-gpu`: the device tier on CUDA (tests/test_device.py, the checks of fzero's CUDA
#                paths, docs/devices.md): a few minutes on one GPU; it fails where no CUDA is.
#                On a GPU machine keep its CUDA torch: `make TORCH=torch test-gpu`.
# `make train` : set up .venv and run the main job: a character-level GPT, FP16 + dynamic loss
#                scaling, 2 ZeRO-1 ranks on CPU (gloo), about 2 minutes.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is installed first, pinned, so pip does not pull a multi-GB CUDA build on a CPU box.
# On a GPU machine: `make TORCH=torch test` (or any torch>=2.4 already in the venv is kept).
TORCH  ?= torch==2.13.0
NPROC  ?= 2
# The multi-rank and end-to-end tests wait on each other's ranks and on process start-up a
# good part of the time: two pytest workers keep both cores of a 2-core box busy.
TEST_JOBS ?= 2
TRAIN_ARGS ?=

.PHONY: setup test test-fast test-gpu train clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,examples]"
	touch $@

# One thread per pytest worker (the ranks and scripts the tests start set the same): two workers
# with a thread per core each would oversubscribe the cores.
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal

test-fast: setup
	$(PY) -m pytest -q -m "unit and not slow"

test-gpu: setup
	FZERO_TEST_DEVICES=cuda $(PY) -m pytest -q -rs -m device tests/test_device.py

# The flags are checked once before torchrun starts: a bad one is one line, not one per rank
# followed by torchrun's report of failed workers.
train: setup
	WORLD_SIZE=$(NPROC) $(PY) examples/train.py --check-args --model gpt --dtype fp16 --device cpu $(TRAIN_ARGS)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) examples/train.py \
		--model gpt --dtype fp16 --device cpu $(TRAIN_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
