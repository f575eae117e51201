#!/usr/bin/env bash
# Issue 33's checks on a GPU machine, in one go, from the repository's root:
#   OUT=/some/folder bash benchmarks/gpu_check.sh
# (a) installs nothing: pipetrain's runtime, the GPU tests and the benchmark need torch, numpy
#     and pytest only (pulp and networkx serve the planner, which none of them imports);
# (b) runs the GPU tests (tests/gpu), about 1-2 minutes (at most 150 s);
# (c) runs benchmarks/gpu_step.py, about 3-4 minutes on an H200 (at most 300 s): its tables go to
#     $OUT/gpu_step.md (the time table is written first, memory rows as they come), logs to $OUT.
# Each part has its own timeout; the whole stays under 8 minutes. Without CUDA it says so and
# exits 0 (nothing to check here: the CPU suite covers the rest). Exit status: 1 if a part
# failed, else 0.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA GPU (torch.cuda.is_available() is False): nothing to check" \
        | tee "$OUT/gpu_check.log"
    exit 0
fi
# Everything the checks import, before any device time goes to them (numpy is the one
# dependency beyond torch and pytest; pulp and networkx are not needed).
if ! python -c "import numpy, pytest, pipetrain, examples.models, torch.distributed.pipelining" \
        > "$OUT/imports.log" 2>&1; then
    echo "gpu_check: a module the checks need is missing:"; tail -3 "$OUT/imports.log"
    exit 1
fi
{ nvidia-smi || true; python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"; } \
    > "$OUT/environment.txt" 2>&1
status=0
echo "== (b) GPU tests: python -m pytest -q -rs -s tests/gpu"
timeout 150 python -m pytest -q -rs -s -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "== (c) benchmarks/gpu_step.py"
timeout 300 python benchmarks/gpu_step.py --rounds 5 --steps 2 --warmup 2 --timeout 200 \
    --out "$OUT/gpu_step.md" 2>&1 | tee "$OUT/gpu_step.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu_check: done, status $status; table in $OUT/gpu_step.md"
exit $status
