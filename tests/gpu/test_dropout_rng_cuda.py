"""Dropout under recomputation with stages on CUDA devices: each stage's stream carries its CUDA
device's generator state too (pipetrain/runtime/rng.py), since CUDA dropout draws from that.

As in tests/runtime/test_dropout_rng.py, every checkpoint mode must train to the parameters of
"never" from the same seed. Several stages on one GPU share its generator as the CPU stages share
the CPU's; a CPU stage beside a GPU stage puts the two kinds of stream side by side. Tolerance
1e-5 (fp32, TF32 off) as in tests/gpu/test_cuda.py: the GPU may pick other kernels between runs.
Without a GPU each test is skipped with its reason; run ``python -m pytest tests/gpu -q -rs``.
"""

from __future__ import annotations

import pytest
import torch

from tests.runtime.test_dropout_rng import train

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
TOLERANCE = 1e-5

LAYOUTS = {
    "stages sharing one GPU": ["cuda:0"] * 4,
    "CPU and GPU stages": ["cpu", "cuda:0", "cpu", "cuda:0"],
    "one GPU per stage": [f"cuda:{i % max(GPUS, 1)}" for i in range(4)],
}



@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_recomputation_on_gpus_trains_as_without(layout, schedule):
    if GPUS == 0:
        pytest.skip("needs a CUDA GPU")
    if layout == "one GPU per stage" and GPUS < 2:
        pytest.skip(f"needs 2 CUDA GPUs to put stages on different GPUs; found {GPUS}")
    devices = LAYOUTS[layout]
    want = train(schedule, "never", devices)
    for checkpoint in ("never", "except_last", "always"):
        got = train(schedule, checkpoint, devices)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=TOLERANCE, msg=key)
