#!/usr/bin/env bash
# One H200 call: the whole unit suite at one seed offset, the host-cost table, the attention benchmark.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
O=${OUT:-RESULTS}; mkdir -p $O
echo "== suite offset ${SEED:-0} $(date +%T)"
timeout ${SUITE_T:-280} python3 -m pytest -q -rfs -n 15 -p no:cacheprovider --durations=12 --seed-offset ${SEED:-0} tests > $O/suite.txt 2>&1
grep -E "passed|failed" $O/suite.txt | tail -1; grep -E "^(FAILED|ERROR)" $O/suite.txt | head -30
echo "== host $(date +%T)"
timeout ${HOST_T:-80} python3 -m fusedlib.bench --host --calls ${CALLS:-150} --repeats 3 --out $O/bench 2>&1 | grep -v "UserWarning\|warnings.warn" | tail -30
echo "== attention $(date +%T)"
timeout ${ATT_T:-80} python3 -m fusedlib.bench --op attention --out $O/bench 2>&1 | grep -v "UserWarning\|warnings.warn\|^bench:" | grep -v "^\s*$" | head -60
date +%T
