#!/usr/bin/env bash
# One call on the GPU machine (see ../shared/gpu/README.md): install the carried wheels,
# then run the steps named in $STEPS (default: test bench host notebooks), writing logs and
# results under $OUT (RESULTS when run by hand). Keep the device time short: one script, one call.
#   STEPS="test bench" SEEDS="0 1 2" bash tools/gpu_session.sh
# Steps:
#   test       unit tests with pytest-xdist (-n $JOBS), once per seed offset in $SEEDS
#   nbval      nbval over $NOTEBOOKS (default: every chapter), one worker per notebook
#   bench      python -m fusedlib.bench --sweep (ops: $BENCH_OPS, default all)
#   host       python -m fusedlib.bench --host (host cost per call)
#   tp2        the tensor-parallel cross-entropy benchmark on two GPUs
#   train      python -m fusedlib.train --bench (chapter 9's runs; $TRAIN_ARGS adds flags)
#   checktp    the tp = 2 GPT against tp = 1 with NCCL (two GPUs)
#   traintp    chapter 9's tp = 2 training run against tp = 1 (two GPUs; $TP_STEPS steps)
#   notebooks  execute $NOTEBOOKS (default: every chapter) in place with nbclient
set -uo pipefail
OUT=${OUT:-RESULTS}
mkdir -p "$OUT"
# NO_INSTALL=1: the wheels are installed already (two sessions side by side, one per GPU)
[ -n "${NO_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
STEPS=${STEPS:-"test bench host notebooks"}
JOBS=${JOBS:-12}
nvidia-smi -L
for step in $STEPS; do
  echo "=== $step $(date +%T)"
  case $step in
    test) first=1
          for s in ${SEEDS:-0}; do
            # the first seed offset runs everything; later ones skip $LATER_SKIP (tests whose inputs
            # do not depend on the seed, e.g. the Inductor compiles and the book build)
            skip=""; [ $first = 1 ] || skip=${LATER_SKIP:-}; first=0
            LIVE_FAILURES="$OUT/live-seed$s.txt" timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rs -n "$JOBS" \
              -p no:cacheprovider -p tools.pytest_live_failures --seed-offset "$s" \
              ${TEST_FILES:-tests} $skip > "$OUT/test-seed$s.txt" 2>&1
            echo "seed offset $s: $(tail -1 "$OUT/test-seed$s.txt")"; grep -E "^(FAILED|ERROR)" "$OUT/test-seed$s.txt" | head -20
          done ;;
    nbval) timeout ${NBVAL_TIMEOUT:-300} python3 -m pytest -q -n 7 --dist loadfile -p no:cacheprovider --nbval \
             --nbval-current-env ${NOTEBOOKS:-chapters/*.ipynb} > "$OUT/nbval.txt" 2>&1
           tail -1 "$OUT/nbval.txt"; grep -E "^(FAILED|ERROR)" "$OUT/nbval.txt" | head -20 ;;
    bench) timeout ${BENCH_TIMEOUT:-400} python3 -m fusedlib.bench --sweep ${BENCH_OPS:+--op $BENCH_OPS} --out chapters/data/bench 2>&1 \
             | grep -v "^bench:\|UserWarning\|warnings.warn\|SyntaxWarning\|Evict LRU" | tee "$OUT/bench.txt" ;;
    host) timeout ${HOST_TIMEOUT:-300} python3 -m fusedlib.bench --host ${HOST_OPS:+--op $HOST_OPS} --out chapters/data/bench 2>&1 \
             | grep -v "UserWarning\|warnings.warn" | tee "$OUT/host.txt" ;;
    tp2) timeout ${TP2_TIMEOUT:-120} python3 -m fusedlib.parallel.bench_tp --tp 2 --out chapters/data/bench 2>&1 | tail -15 | tee "$OUT/tp2.txt" ;;
    train) timeout ${TRAIN_TIMEOUT:-420} python3 -m fusedlib.train --bench --out chapters/data/bench ${TRAIN_ARGS:-} 2>&1 \
             | grep -v "UserWarning\|warnings.warn" | tail -40 | tee "$OUT/train.txt" ;;
    checktp) timeout ${CHECKTP_TIMEOUT:-180} torchrun --nproc-per-node 2 -m fusedlib.parallel.check_tp 2>&1 | tail -30 \
               | tee "$OUT/checktp.txt" ;;
    traintp) timeout ${TRAINTP_TIMEOUT:-240} torchrun --nproc-per-node 2 -m fusedlib.train --bench-tp --steps ${TP_STEPS:-500} \
               --out chapters/data/bench 2>&1 | grep -v "UserWarning\|warnings.warn" | tail -30 | tee "$OUT/traintp.txt" ;;
    notebooks) timeout ${NB_TIMEOUT:-420} python3 tools/execute_notebooks.py ${NOTEBOOKS:-} 2>&1 | tee "$OUT/notebooks.txt" ;;
    *) echo "unknown step $step" ;;
  esac
done
tar czf "$OUT/results.tgz" chapters/*.ipynb chapters/data
