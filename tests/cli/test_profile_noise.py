"""Profiling noise (issue 31, item 11): each layer's spread of repeats is recorded and shown,
a layer whose repeats lie far apart is named in a warning with the ways out, and the CLI's
default thread count is what a rank of training gets (the cores / ranks per node)."""

from __future__ import annotations

import json
import os
import shlex
import time

import pytest
import torch
from torch import nn

from partitioner import LayerCost, Profile
from pipetrain.tools.cli import main
from pipetrain.tools.profiler import ProfileNoiseWarning, profile

pytestmark = pytest.mark.usefixtures("one_thread")

JITTER = '''
import time
from torch import nn


class Jitter(nn.Module):
    """A layer that takes 20 ms on every third call and 0 ms on the others, as on a busy
    machine (a period of three: whether a profiling sweep runs one forward or two, the timed
    calls meet fast and slow ones)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        time.sleep(0.02 * (self.calls % 3 == 1))
        return x * 1.0


def model():
    return nn.Sequential(nn.Linear(8, 8), Jitter(), nn.Linear(8, 8))
'''


class Jitter(nn.Module):
    """A layer that takes 20 ms on every third call and 0 ms on the others, as on a busy
    machine (a period of three: whether a profiling sweep runs one forward or two, the timed
    calls meet fast and slow ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        time.sleep(0.02 * (self.calls % 3 == 1))
        return x * 1.0


def test_a_noisy_layer_is_named_in_a_warning() -> None:
    model = nn.Sequential(nn.Linear(8, 8), Jitter(), nn.Linear(8, 8))
    with pytest.warns(ProfileNoiseWarning, match=r"layer 1 \(1:Jitter\) \d+%") as caught:
        result = profile(model, torch.randn(4, 8), warmup=0, repeats=4)
    assert "more repeats (repeats=10)" in str(caught[0].message)
    assert "torch.set_num_threads" in str(caught[0].message)
    assert result.layers[1].spread > 0.5 and 1 in result.noisy()  # (others, if busy here)
    assert Profile.from_json(result.to_json()) == result  # the spread is in the file


def test_profiles_without_a_spread_still_load() -> None:
    layer = LayerCost("0", 0.001, 0.002, 16, 4, 16)
    data = json.loads(Profile("cpu", 4, [layer]).to_json())
    del data["layers"][0]["spread"]
    assert Profile.from_json(json.dumps(data)).layers[0].spread == 0.0


def test_cli_shows_the_spread_and_warns_in_flags(tmp_path, capsys, monkeypatch) -> None:
    (tmp_path / "jitter.py").write_text(JITTER)
    monkeypatch.chdir(tmp_path)
    code = main(shlex.split(
        "profile jitter.py:model --input-shape 4,8 --warmup 0 --repeats 4 --threads 1"
    ))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "spread" in out.splitlines()[0]
    row = next(line for line in out.splitlines() if line.startswith("1:Jitter"))
    assert row.endswith(" noisy")
    assert "warning:" in err and "layer 1 (1:Jitter)" in err
    assert "more repeats (--repeats 10)" in err and "repeats=" not in err


def test_cli_threads_default_to_a_ranks_share_of_the_cores(tmp_path, capsys, monkeypatch) -> None:
    """Before, torch's own default (every core) timed each layer against the other ranks'."""
    (tmp_path / "jitter.py").write_text(JITTER)
    monkeypatch.chdir(tmp_path)
    cores = len(os.sched_getaffinity(0))
    for ranks, want in [(1, cores), (2, max(1, cores // 2)), (cores + 1, 1)]:
        path = tmp_path / f"p{ranks}.json"
        code = main(shlex.split(
            f"profile jitter.py:model --input-shape 4,8 --warmup 0 --repeats 1 "
            f"--ranks-per-node {ranks} -o {path}"
        ))
        out, err = capsys.readouterr()
        assert code == 0, err
        assert f"{want} torch threads (the {cores} cores / --ranks-per-node {ranks}" in out
        assert Profile.load(path).device.endswith(f", {want} threads")
