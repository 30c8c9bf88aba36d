#!/usr/bin/env bash
# One call on the GPU machine (see ../shared/gpu/README.md): install the carried wheels,
# then run the steps named in $STEPS (default: test bench notebooks), writing logs and results
# under $OUT (RESULTS when run by hand). Keep the device time short: one script, one call.
#   STEPS="test bench" bash tools/gpu_session.sh
set -uo pipefail
OUT=${OUT:-RESULTS}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
STEPS=${STEPS:-"test bench notebooks"}
nvidia-smi -L
for step in $STEPS; do
  echo "=== $step"
  case $step in
    test) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q --maxfail=10 -p no:cacheprovider -W ignore::UserWarning \
            ${TEST_FILES:-tests} > "$OUT/test.txt" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/test.txt" | tail -15 ;;
    bench) timeout ${BENCH_TIMEOUT:-300} python3 -m fusedlib.bench --sweep ${BENCH_OPS:+--op $BENCH_OPS} --out chapters/data/bench 2>&1 \
             | grep -v "^bench:\|UserWarning\|warnings.warn\|SyntaxWarning\|Evict LRU" | tee "$OUT/bench.txt" ;;
    tp2) timeout ${TP2_TIMEOUT:-120} python3 -m fusedlib.parallel.bench_tp --tp 2 --out chapters/data/bench 2>&1 | tail -15 | tee "$OUT/tp2.txt" ;;
    notebooks) timeout ${NB_TIMEOUT:-420} python3 tools/execute_notebooks.py ${NOTEBOOKS:-} 2>&1 | tee "$OUT/notebooks.txt" ;;
    *) echo "unknown step $step" ;;
  esac
done
tar czf "$OUT/results.tgz" chapters/*.ipynb chapters/data
