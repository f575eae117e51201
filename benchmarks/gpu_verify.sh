#!/usr/bin/env bash
# The short GPU check of the CUDA-graph fixes (slots with their own static inputs, no garbage
# collection during a capture, the CUDA generator taken out of capture mode after a failed
# capture, losses read as floats), from the repository's root:
#   OUT=/some/folder bash benchmarks/gpu_verify.sh
# Runs three GPU test files only, stopping at the first failure, under a 90 s limit; the
# output goes to $OUT/verify.log. Exit status: pytest's (124 if it ran past 90 s).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-verify-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 90 python -m pytest -q -rs -x -p no:cacheprovider \
    tests/gpu/test_cuda_graphs.py tests/gpu/test_graphs_host_sync.py tests/gpu/test_step_sync.py \
    > "$OUT/verify.log" 2>&1
status=$?
tail -5 "$OUT/verify.log"
exit $status
