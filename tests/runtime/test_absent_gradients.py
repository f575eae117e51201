"""Weights no backward reaches in a step, under data-parallel replicas: 2 stages x 2 replicas
on real gloo processes against single-process training of the whole mini-batch (AdamW with
weight decay, clipped by the global norm, 3 steps), at every zero level.

In one process such a weight keeps ``.grad`` None and AdamW skips it (no decay, no moment
update); the replicas' all-reduce must not turn it into a zero gradient the optimizer then
steps (pipetrain/runtime/data_parallel.py). The model has each kind:

(a) a layer whose output is detached before the next layer (its weights get no gradient);
(b) a submodule of a layer that its forward never calls, in a layer used on both stages (a
    weight tied across stages that no stage's backward reaches);
(c) a weight used only for samples marked in the batch: step 1 marks one sample of replica 0
    (its first micro-batch), step 2 none (absent everywhere, after a step that gave it AdamW
    moments, which a zero gradient would move it by), step 3 one of replica 1 (its last
    micro-batch): present on one replica only, it must get the replicas' averaged gradient.
    It is the first weight of stage 0 that gets a gradient (after the detached layer), so at
    zero 2 and 3 whether the next layer's inputs require gradients depends on the batch too
    (which once made FSDP2's reduce-scatters come in different orders: sharding.py).

Tolerance 1e-5 (fp32), as test_zero.py: the replicas and micro-batches sum the mini-batch's
contributions in another order (measured: 6e-8 at most); the defect moved the weights without
gradients by 5e-3 to 4e-2 at zero 0 and 1 (the decay alone is lr * weight_decay * w = 5e-3 * w
per step, and moments moved by a zero gradient move a weight by up to lr), and aborted zero 2
and 3 (FSDP2's reduce-scatters differed between the replicas).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import pipetrain
from pipetrain.runtime import readback
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import batches, mlp
from tests.runtime.test_step_cost import fused_sgd, host_syncs, plain_sgd

STEPS = 3
CLIP = 0.5
TOLERANCE = 1e-5
MARK = 5.0  # column 0 of a marked sample; the others lie in [-2, 2]
BATCH, WIDTH, CLASSES = 8, 6, 5


class Affine(nn.Module):
    """An elementwise scale and shift (starts as the identity: column 0 passes unchanged)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.bias


class Detach(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()


class Marked(nn.Module):
    """Adds ``shift`` to the marked samples only; a micro-batch without one never reads it."""

    def __init__(self, width: int):
        super().__init__()
        self.shift = nn.Parameter(torch.full((width,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        marked = x[:, :1] > MARK / 2
        if not bool(marked.any()):
            return x
        return torch.where(marked, x + self.shift, x)


class WithUnused(nn.Module):
    """A layer holding a submodule its forward never calls."""

    def __init__(self, width: int):
        super().__init__()
        self.used = nn.Linear(width, width)
        self.unused = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.used(x))


BALANCE = [6, 4]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    shared = WithUnused(8)  # on both stages: its weights are tied across them
    return nn.Sequential(
        Affine(WIDTH), Detach(), Marked(WIDTH), nn.Linear(WIDTH, 8), nn.Tanh(), shared,
        nn.Linear(8, 8), nn.Tanh(), shared, nn.Linear(8, CLASSES),
    )


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step 1 marks sample 1 (replica 0, micro-batch 0), step 2 none, step 3 sample 7 (replica
    1, its last micro-batch)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for marked in (1, None, 7):
        x = torch.randn(BATCH, WIDTH, generator=g).clamp(-2, 2)
        if marked is not None:
            x[marked, 0] = MARK
        out.append((x, torch.randint(0, CLASSES, (BATCH,), generator=g)))
    return out


def adamw(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def single_process() -> dict[str, torch.Tensor]:
    """The steps in one process over the whole mini-batch."""
    net = model()
    opt = adamw(net.parameters())
    for x, y in data():
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
    return net.state_dict()


def _train(
    rank: int, world: int, levels: tuple[int, ...], schedule: str = "1f1b"
) -> dict[int, dict]:
    """Per zero level, this rank's whole parameters after the steps, and which of its
    stage's weights have a gradient after the last step."""
    out = {}
    for zero in levels:
        pipe = pipetrain.Pipeline(
            model(), BALANCE, chunks=2, schedule=schedule, replicas=2, zero=zero,
            loss_fn=nn.functional.cross_entropy, optimizer=adamw, clip_grad_norm=CLIP,
            timeout=60,
        )
        share = BATCH // 2
        part = slice(pipe.placement.replica * share, (pipe.placement.replica + 1) * share)
        for x, y in data():
            pipe.train_step(x[part], y[part])
        state = pipe.module.state_dict()
        out[zero] = {
            "state": {k: v.full_tensor() if isinstance(v, DTensor) else v
                      for k, v in state.items()},
            "grads": {n: p.grad is not None for n, p in pipe.module.named_parameters()},
        }
    return out


def _largest_difference(levels: tuple[int, ...], schedule: str) -> dict[int, tuple[float, str]]:
    """Per zero level, the largest difference to one process over every parameter of every
    rank; and every rank's weights without a gradient after the last step are those one
    process has none for (the detached layer's, the unused submodule's on either stage)."""
    expected = single_process()
    unused = {f"{i}.unused.{k}" for i in (5, 8) for k in ("weight", "bias")}
    absent = {"0.weight", "0.bias"} | unused
    worst: dict[int, tuple[float, str]] = {z: (0.0, "") for z in levels}
    for ranks in values(run_ranks(_train, 4, levels, schedule, deadline=300)):
        for zero, got in ranks.items():
            for key, value in got["state"].items():
                diff = (value - expected[key]).abs().max().item()
                worst[zero] = max(worst[zero], (diff, key))
            gradients = got["grads"]
            assert {n for n, has in gradients.items() if not has} == absent & set(gradients)
    return worst


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_weights_without_gradients_train_as_in_one_process_over_replicas(schedule):
    """Under 1F1B, and under a split backward (W makes the weight gradients; at zero 2 and 3
    the reduce-scatters wait for the last W)."""
    worst = _largest_difference((0, 1, 2, 3), schedule)
    print("largest parameter difference per zero level:", worst)
    for zero, (diff, key) in worst.items():
        assert diff <= TOLERANCE, (zero, key, diff)


def test_the_model_has_each_kind_of_absent_weight():
    """The cases exist: in one process, (a) and (b) never get a gradient, (c) only in steps
    1 and 3."""
    net = model()
    seen = []
    for x, y in data():
        net.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        seen.append({n for n, p in net.named_parameters() if p.grad is None})
    never = {"0.weight", "0.bias", "5.unused.weight", "5.unused.bias"}
    assert seen == [never, never | {"2.shift"}, never]


def _host_syncs(rank: int, world: int) -> dict[str, tuple[int, int]]:
    """Host syncs in 2 steps of 2 stages x 2 replicas, per zero level: of a model whose every
    weight gets a gradient, and of the same model behind a detached layer (stage 0's first
    weights never get one); as ``.item()``-like calls (the profiler's count, test_step_cost.py)
    and as reads of the presence (readback.wait_for: ``.tolist()``, which the profiler does
    not see, a host sync on CUDA all the same). At zero 0 the optimizer skips on the device
    (fused SGD); FSDP2's DTensors have no fused SGD, so at zero 2 the host reads whether to
    step (1 per step)."""
    reads = [0]
    wait_for = readback.wait_for

    def counted(tensor: torch.Tensor) -> list:
        reads[0] += 1
        return wait_for(tensor)

    readback.wait_for = counted  # type: ignore[assignment]
    counts = {}
    for zero, optimizer in ((0, fused_sgd), (2, plain_sgd)):
        for name, net, balance in (
            ("all used", mlp(), [5, 7]),
            ("detached", nn.Sequential(Affine(12), Detach(), *mlp()), [7, 7]),
        ):
            pipe = pipetrain.Pipeline(
                net, balance, chunks=2, schedule="1f1b", replicas=2, zero=zero,
                loss_fn=nn.functional.cross_entropy, optimizer=optimizer, timeout=60,
            )
            mini_batches = [(x[:12], y[:12]) for x, y in batches(3)]
            pipe.train_step(*mini_batches[0])  # warm-up: optimizer state
            reads[0] = 0
            syncs = host_syncs(
                lambda p=pipe, d=mini_batches: [p.train_step(*b) for b in d[1:]], steps=1
            )
            counts[f"{name}, zero {zero}"] = syncs, reads[0]
    return counts


def test_only_a_rank_missing_a_gradient_waits_for_the_host():
    """No host sync added where every weight has a gradient (the presence rides unread: 0
    per step at zero 0); 1 per step (reading the replicas' presence) on the ranks of a stage
    with a weight that has none, and none on the others."""
    for rank, counts in enumerate(values(run_ranks(_host_syncs, 4, deadline=300))):
        missing = 2 if rank % 2 == 0 else 0  # ranks 0, 2 hold stage 0; 2 steps
        for zero, base in ((0, 0), (2, 2)):
            assert counts[f"all used, zero {zero}"] == (base, 0), (rank, counts)
            assert counts[f"detached, zero {zero}"] == (base, missing), (rank, counts)
