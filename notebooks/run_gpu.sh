#!/usr/bin/env bash
# Run notebooks at JDET_NB_SCALE=gpu in parallel, each on its own GPUs, on a machine without Jupyter.
#
#   JDET_NB_COMMIT=abc1234 OUT=/path/out bash notebooks/run_gpu.sh 03 04 05 02=0,1,2,3
#
# Each argument names a notebook by its number (03 -> notebooks/03_*.ipynb). A bare number takes the
# next free GPU index (in order, skipping indices that an NN=LIST argument names); NN=0,1 gives that
# notebook those GPUs (notebook 02 wants 2 or 4). Why a script: the device call has a hard time limit,
# so the notebooks run side by side (one process each, CUDA_VISIBLE_DEVICES set, so no two JAX
# processes share a GPU), each under its own `timeout` so one that hangs does not take the others'
# results with it (notebooks/execute.py writes the notebook after every cell: a notebook cut short
# keeps what it computed).
#
# Writes $OUT/notebooks/NN_*.ipynb, $OUT/logs/NN_*.log (each cell's time and any traceback) and
# $OUT/logs/summary.txt. Exit status 1 if any notebook failed or timed out.
# Environment: OUT (default ./nb_out); NB_TIMEOUT seconds per notebook (default 540); JDET_NB_COMMIT
# (the commit the notebooks state: a copy of the tree without .git cannot find it); PYTHON, the
# interpreter (default python3); anything else (JDET_NB_USER_BENCH for 06, XLA_*) passes through.
# Each notebook compiles into its own cache, $JDET_NB_CACHE/<notebook> (default under
# /tmp/jdet-nb-cache): no two processes write one cache, and a second run on a still-warm machine
# loads what the first compiled.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-./nb_out}
NB_TIMEOUT=${NB_TIMEOUT:-540}
CACHE=${JDET_NB_CACHE:-/tmp/jdet-nb-cache}
mkdir -p "$OUT/notebooks" "$OUT/logs"
nvidia-smi >"$OUT/logs/nvidia-smi.txt" 2>&1 || true
if [ $# -eq 0 ]; then
    echo "usage: bash notebooks/run_gpu.sh NN[=GPU,GPU...] ...  (e.g. 03 04 05 02=0,1,2,3)" >&2
    exit 2
fi
if [ -z "${JDET_NB_COMMIT:-}" ]; then
    JDET_NB_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || true)
    [ -n "$JDET_NB_COMMIT" ] || echo "warning: JDET_NB_COMMIT unset and no .git: notebooks state commit 'unknown'" >&2
fi
export JDET_NB_COMMIT JDET_NB_SCALE=gpu MPLBACKEND=Agg PYTHONUNBUFFERED=1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-$(command -v python3 || command -v python)}  # the GPU image has python3, maybe no `python`

taken=","
for spec in "$@"; do
    case $spec in *=*) taken="$taken${spec#*=}," ;; esac
done
next=0
names=() paths=() gpus=()
for spec in "$@"; do  # every argument checked before anything starts
    num=${spec%%=*}
    path=$(ls notebooks/"$num"_*.ipynb 2>/dev/null | head -n 1)
    if [ -z "$path" ]; then
        echo "no notebook notebooks/${num}_*.ipynb" >&2
        exit 2
    fi
    if [ "$spec" != "$num" ]; then
        dev=${spec#*=}
    elif [ "$num" = 02 ]; then
        echo "notebook 02 runs TP 2 and 4 and needs several GPUs: name them, e.g. 02=0,1,2,3" >&2
        exit 2
    else
        while [[ $taken == *",$next,"* ]]; do next=$((next + 1)); done
        dev=$next
        next=$((next + 1))
    fi
    names+=("$(basename "$path" .ipynb)") paths+=("$path") gpus+=("$dev")
done
for i in "${!names[@]}"; do
    name=${names[$i]}
    mkdir -p "$CACHE/$name"
    echo "== $name on GPU(s) ${gpus[$i]}, timeout ${NB_TIMEOUT} s, commit ${JDET_NB_COMMIT:-unknown}"
    (
        t0=$(date +%s)
        CUDA_VISIBLE_DEVICES=${gpus[$i]} JDET_CACHE_DIR="$CACHE/$name" \
            timeout -k 15 "$NB_TIMEOUT" "$PY" notebooks/execute.py "${paths[$i]}" "$OUT/notebooks/$name.ipynb" \
            >"$OUT/logs/$name.log" 2>&1
        echo "$? $(($(date +%s) - t0))" >"$OUT/logs/$name.rc"
    ) &
done
wait

failed=0
summary="notebook | GPUs | exit (124: timed out after ${NB_TIMEOUT} s) | seconds"
for i in "${!names[@]}"; do
    read -r rc secs <"$OUT/logs/${names[$i]}.rc"
    [ "$rc" -eq 0 ] || failed=1
    summary="$summary
${names[$i]} | ${gpus[$i]} | $rc | $secs"
done
for name in "${names[@]}"; do
    echo "---- $name: the last lines of its log"
    tail -n 8 "$OUT/logs/$name.log"
done
echo "$summary" | tee "$OUT/logs/summary.txt"
exit $failed
