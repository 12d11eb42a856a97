#!/usr/bin/env bash
# bench/gpu_train.py case by case, each under `timeout`, the results packed into $OUT/gpu_train.tgz after every case
# (a case that hangs or dies costs only itself; what ran before it is already packed). Prints the table at the end.
#   OUT=/tmp/out bench/gpu_train.sh            on a GPU machine (device tool: $OUT comes back)
#   SMALL=1 OUT=/tmp/out bench/gpu_train.sh    the CPU rehearsal, tiny models, under a minute
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_train_out}
RESULTS="$OUT/gpu_train"
PYTHON=${PYTHON:-python3}
mkdir -p "$RESULTS"
# Packages the GPU image lacks (fivefold needs tomli-w) travel as wheels in .whl/, downloaded beforehand with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl tomli-w
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee "$RESULTS/log.txt"
"$PYTHON" bench/gpu_train.py --list | while read -r case limit; do
    echo "== $case (timeout ${limit}s)" | tee -a "$RESULTS/log.txt"
    timeout --kill-after=10 "$limit" "$PYTHON" bench/gpu_train.py --case "$case" --results "$RESULTS" \
        >>"$RESULTS/log.txt" 2>&1
    status=$?
    [ "$status" -eq 0 ] || echo "$case: exit $status" | tee -a "$RESULTS/log.txt"
    "$PYTHON" bench/gpu_train.py --summary --results "$RESULTS" >"$RESULTS/summary.txt" 2>&1
    tar czf "$OUT/gpu_train.tgz" -C "$OUT" --exclude='*/checkpoints' gpu_train
done
cat "$RESULTS/summary.txt"
