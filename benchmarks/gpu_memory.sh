#!/usr/bin/env bash
# GPU memory of AccumModel against plain Keras, on JAX and PyTorch: the one
# command for a GPU machine with python3, JAX (CUDA) and PyTorch (CUDA), but
# no network, no TensorFlow and no Keras.
#
# Installs the wheels in .whl/ (Keras and what it needs beyond the machine's
# packages) into /tmp/site, then, for each backend and each copy of the
# package (`new`: this working tree; `baseline`: .gpu/baseline, an older
# keras_accum), runs `bench_gpu_memory.py` (wide MLP and CNN, every variant
# in fresh processes, REPEATS runs each, median; the CNN dataset-size sweep
# on `new` only). The four run side by side: each process reads its own
# allocator, so they do not disturb each other's figures. Writes
# $OUT/gpu_memory_<backend>.json (`new`, the file benchmarks/results/ keeps)
# and $OUT/gpu_memory_<backend>_baseline.json, the table $OUT/gpu_memory.txt
# and the log $OUT/log.txt; nothing else goes to $OUT.
#
#     OUT=/tmp/gpuout benchmarks/gpu_memory.sh
#
# Made beforehand (both git-ignored): .whl/ by `pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64
# -d .whl keras==3.15.1 namex optree` (the machine's other packages cover
# Keras's needs), and the baseline by `mkdir -p .gpu/baseline && git archive
# <commit> keras_accum | tar -x -C .gpu/baseline`.
#     OUT=/tmp/gpuout PY=.venv/bin/python SKIP_WHEELS=1 benchmarks/gpu_memory.sh
#
# Knobs (environment): PY (python3), SKIP_WHEELS=1, BUDGET_S (seconds after
# which no measured process starts; 300), REPEATS (3), BACKENDS ("jax
# torch"), ROOTS ("new baseline"), MODELS (wide_mlp,cnn), JOBS_NEW (4) and
# JOBS_BASELINE (2) processes at once, NEW_CONFIGS (all of CONFIGS),
# BASELINE_CONFIGS (the variants that use keras_accum, and Model(B) beside
# them), SWEEP (1; 0: no sweep), EXTRA (more bench_gpu_memory.py arguments).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
: "${OUT:?set OUT to the folder for the results}"
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-300}
REPEATS=${REPEATS:-3}
BACKENDS=${BACKENDS:-"jax torch"}
ROOTS=${ROOTS:-"new baseline"}
MODELS=${MODELS:-wide_mlp,cnn}
JOBS_NEW=${JOBS_NEW:-4}
JOBS_BASELINE=${JOBS_BASELINE:-2}
BASELINE_CONFIGS=${BASELINE_CONFIGS:-plain:1,accum:4,accum:16,accum:64}
SWEEP=${SWEEP:-1}
NEW_CONFIGS=${NEW_CONFIGS:-}
EXTRA=${EXTRA:-}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export TF_CPP_MIN_LOG_LEVEL=3
DEADLINE=$(($(date +%s) + BUDGET_S))
mkdir -p "$OUT"

versions() {
    nvidia-smi -L || echo "nvidia-smi: none"
    "$PY" - <<'EOF'
import importlib, os, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("numpy", "keras", "optree", "namex", "jax", "jaxlib", "torch"):
    os.environ["KERAS_BACKEND"] = "jax"
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), module.__file__)
    except Exception as error:  # noqa: BLE001 (reported, not fatal here)
        print(name, "FAILED", repr(error))
try:
    import jax
    print("jax devices", jax.devices())
except Exception as error:  # noqa: BLE001
    print("jax devices FAILED", repr(error))
try:
    import torch
    print("torch cuda", torch.cuda.is_available(), torch.version.cuda)
except Exception as error:  # noqa: BLE001
    print("torch cuda FAILED", repr(error))
print("tensorflow imported:", sys.modules.get("tensorflow") is not None)
EOF
}

# One backend and one copy of the package: its JSON, its lines prefixed.
run_one() {
    local backend=$1 root=$2 dir jobs left out args=()
    if [ "$root" = new ]; then
        dir=$ROOT
        jobs=$JOBS_NEW
        out=$OUT/gpu_memory_${backend}.json
        [ "$SWEEP" = 1 ] && args+=(--with-sweep)
        [ -n "$NEW_CONFIGS" ] && args+=("--configs=$NEW_CONFIGS")
    else
        dir=$ROOT/.gpu/baseline
        jobs=$JOBS_BASELINE
        out=$OUT/gpu_memory_${backend}_baseline.json
        args+=("--configs=$BASELINE_CONFIGS")
    fi
    if [ ! -d "$dir/keras_accum" ]; then
        echo "no $dir/keras_accum: skipped"
        return 1
    fi
    export PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} KERAS_BACKEND=$backend
    # -P: not the current folder first, as for the benchmark's processes.
    "$PY" -P -c "import keras_accum; print('keras_accum:', keras_accum.__file__)" \
        || return 1
    left=$((DEADLINE - $(date +%s)))
    # --budget-s stops starting runs in time; `timeout` is the backstop.
    # shellcheck disable=SC2086  # EXTRA: several arguments
    timeout -k 10 $((left + 60)) "$PY" benchmarks/bench_gpu_memory.py \
        --backend="$backend" --models="$MODELS" --repeats="$REPEATS" \
        --jobs="$jobs" --budget-s="$left" "${args[@]}" --out="$out" $EXTRA
}

main() {
    echo "== $(date -u) on $(hostname); OUT=$OUT"
    if [ "${SKIP_WHEELS:-0}" != 1 ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
        echo "installed $(ls .whl | tr '\n' ' ')into /tmp/site"
    fi
    versions
    echo "== measuring until $((BUDGET_S - SECONDS))s from now:" \
        "backends $BACKENDS, roots $ROOTS"
    local pids=() backend root status=0
    for backend in $BACKENDS; do
        for root in $ROOTS; do
            (
                set -o pipefail
                run_one "$backend" "$root" 2>&1 \
                    | sed -u "s/^/[$backend $root] /"
            ) &
            pids+=($!)
        done
    done
    for pid in "${pids[@]}"; do
        wait "$pid" || status=1
    done
    rm -f "$OUT"/.*.partial
    echo "== table ($SECONDS s since start)"
    "$PY" benchmarks/gpu_memory_table.py "$OUT" || status=1
    echo "== done in $SECONDS s, status $status"
    return $status
}

main 2>&1 | tee "$OUT/log.txt"
