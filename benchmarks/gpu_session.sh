#!/usr/bin/env bash
# One call on a lent GPU machine (15 minutes of device time a session, start-up included):
# install the wheels carried in .whl/ (packages that machine lacks: pydantic, ftfy, rensa and
# theirs; `bash benchmarks/gpu_wheels.sh` here fetches them), then run either the GPU suite
# (issue 6) or the GPU demo (issue 5), bounded so that the call ends in time (SIGINT at the
# limit: the trainer stops at once, what was measured is already written; killed 20 s later if
# not), with logs and JSON under $OUT (8 files at most come back: the demo's are 8).
#
#     bash benchmarks/gpu_session.sh suite [seconds]   # benchmarks/gpu_suite.py, default 480 s
#     bash benchmarks/gpu_session.sh demo [seconds]    # scaletrain demo --device cuda, default 540 s
#
# The demo bounds itself to 8 minutes (--minutes): it times the sweep's shapes on the GPU first
# and scales its budgets down if the sweep and the final run would not fit; the timeout is the
# backstop.
set -u
what=${1:-suite}
case "$what" in suite|demo) ;; *) echo "usage: gpu_session.sh suite|demo [seconds]"; exit 2 ;; esac
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
if ! python3 -c "import pydantic, ftfy, rensa, xxhash" 2>"$out/machine.txt"; then
    echo "missing packages ($(tail -1 "$out/machine.txt")): run 'bash benchmarks/gpu_wheels.sh' here and carry .whl"
    exit 1
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch; print(torch.__version__)"
  python3 -c "import torchao; print('torchao', torchao.__version__)"; } > "$out/machine.txt" 2>&1
case "$what" in
    suite) timeout -s INT -k 20 "${2:-480}" python3 benchmarks/gpu_suite.py --out "$out/suite.json" 2>&1 | tee "$out/suite.log" ;;
    demo) timeout -s INT -k 20 "${2:-540}" python3 -m scaletrain.cli demo --device cuda --out /tmp/demo 2>&1 | tee "$out/demo.log"
          # (results.csv holds what the sweep finished and timing.json the calibration's prediction,
          # should the demo be cut off before demo.json)
          cp /tmp/demo/demo.json /tmp/demo/timing.json /tmp/demo/sweep/results.csv /tmp/demo/sweep/law.json \
             /tmp/demo/data/stats.json "$out/" 2>/dev/null
          cp /tmp/demo/final/metrics.jsonl "$out/final-metrics.jsonl" 2>/dev/null ;;
esac
