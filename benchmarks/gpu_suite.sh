#!/usr/bin/env bash
# The GPU checks, in one script of about 8 minutes on one H200. First the device tier of the tests
# (tests/test_device.py: is fzero correct on this device?): if it fails, nothing is timed. Then
# the no-host-sync check, the optimizer-step table at 1e9 elements (eager and compiled from the
# grads pytree, each with donate=True and pure, against fused AdamW and fresh outputs; flat; the
# ideal mixed-precision step (AdamW alone in one compiled loop) and fzero against it; and
# a profile of one step of each compiled row: its host time beside its kernels'), the eager
# step's bytes per element, the BF16 step with an FP32 against a remainder master, the
# step with BF16 and 8-bit moments against FP32 ones (eager and compiled), the memory table (with CPU offload's device bytes and step time), and the main job's step against
# the torch recipe at GPT-2-small shape (e2e.py), checkpoint.save against async_save at 1e9 elements (staging
# into pinned memory on a side stream: checkpoint.py), and Muon + AdamW against AdamW at 1e9 elements (muon.py).
# Results land in $OUT (default benchmarks/results/gpu).
#   bash benchmarks/gpu_suite.sh            # full sizes, on the GPU machine
#   QUICK=1 bash benchmarks/gpu_suite.sh    # tiny sizes: rehearse the script on a CPU
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
PY=${PY:-python}
if [ -n "${QUICK:-}" ]; then
  STEP="--numel 2e5 --tensors 20 --iters 3 --device cpu --profile 20"; MEM="--sizes 1e6 --world-sizes 1 8 --device cpu --offload-sizes 1e5"
  E2E="--quick --device cpu"
else
  STEP="--numel 1e9 --device cuda --profile 20"; MEM="--sizes 124439808 1e9 --world-sizes 1 8 64 --device cuda --max-gib 100 --offload-sizes 124439808"
  E2E="--device cuda --config gpt2 --dtype fp16 bf16 --ranks 1 --batch 16 --steps 10 --rounds 3"
fi
run() { echo "== $*"; timeout "${LIMIT:-200}" "$PY" "$@" 2>&1 | tee -a "$OUT/suite.log"; }
: > "$OUT/suite.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null | tee -a "$OUT/suite.log"
# fzero needs optree >= 0.14; a bare GPU machine may not have it: carry its wheel and install it first.
if ! "$PY" -c "import optree, sys; sys.exit(tuple(map(int, optree.__version__.split('.')[:2])) < (0, 14))" 2>/dev/null; then
  echo "optree >= 0.14 is not importable by $PY: install its wheel (pip install --no-index optree-*.whl) and rerun" | tee -a "$OUT/suite.log"
  exit 1
fi
# transforms/ and models/ are fzero.transforms and fzero.models (found through the checkout's root
# when fzero is not installed): a copy of the checkout without them cannot import them.
if ! "$PY" -c "import fzero.transforms, fzero.models" 2>/dev/null; then
  echo "fzero.transforms is not importable by $PY: the folders transforms/ and models/ must come with the checkout" | tee -a "$OUT/suite.log"
  exit 1
fi
# Correctness before speed: the device tier on CUDA (on the CPU when rehearsing), and no timing
# at all unless it passes.
DEVICES=$([ -n "${QUICK:-}" ] && echo cpu || echo cuda)
echo "== device tier: FZERO_TEST_DEVICES=$DEVICES pytest -m device tests/test_device.py" | tee -a "$OUT/suite.log"
if ! FZERO_TEST_DEVICES=$DEVICES timeout 300 "$PY" -m pytest -q -rs -p no:cacheprovider -m device tests/test_device.py 2>&1 \
    | tee "$OUT/device_tier.log" | tee -a "$OUT/suite.log"; then
  echo "the device tier failed on $DEVICES ($OUT/device_tier.log): fzero is not correct here, so nothing is timed" | tee -a "$OUT/suite.log"
  exit 1
fi
run benchmarks/sync_check.py
LIMIT=300 run benchmarks/step.py $STEP --json "$OUT/step.json"
run benchmarks/plot.py "$OUT/step.json" -o "$OUT/step.png"
run benchmarks/traffic.py $([ -n "${QUICK:-}" ] && echo --quick --device cpu || echo --numel 1e9 --device cuda) --json "$OUT/traffic.json"
run benchmarks/master.py $([ -n "${QUICK:-}" ] && echo --quick --device cpu || echo --numel 1e9 --device cuda) --json "$OUT/master.json"
LIMIT=240 run benchmarks/moments.py $([ -n "${QUICK:-}" ] && echo --quick --device cpu || echo --numel 1e9 --device cuda --iters 5 --rounds 3) --json "$OUT/moments.json"
run benchmarks/memory.py $MEM --json "$OUT/memory.json"
LIMIT=300 run benchmarks/e2e.py $E2E --json "$OUT/e2e.json"
LIMIT=200 run benchmarks/checkpoint.py $([ -n "${QUICK:-}" ] && echo --quick --device cpu --states big --no-writers --nice 19 || echo --device cuda --states big --numel 1e9 --rounds 2 --steps 3 --no-writers --nice 19) --json "$OUT/checkpoint.json"
LIMIT=240 run benchmarks/muon.py $([ -n "${QUICK:-}" ] && echo --device cpu --config nano --ranks 1 --rounds 2 || echo --device cuda --ranks 1 --blocks 40 --width 1024 --rounds 3) --json "$OUT/muon.json"
echo "results in $OUT"
