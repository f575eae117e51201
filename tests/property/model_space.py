"""The space of models and training set-ups the property tests draw from.

A model is a tuple of layer tokens (strings), the vocabulary of what users put in an
``nn.Sequential``: Linear, Conv1d, Embedding with a head tied to it, LayerNorm, BatchNorm,
Dropout, in-place and plain activations, parameterless reshapes (Flatten, a reshape, a slice, a
transpose), a detached path, frozen layers and frozen parameters, layers returning a tuple, their
own input or views, residual blocks, a module used again later (``again:J`` reuses layer J's
module) and an affine layer whose Parameters every such layer shares. :func:`build_model` turns
the tokens into the model, the same in every process; :func:`draw_case` draws a whole
:class:`Case` (model, balance, schedule, placement, micro-batches, checkpoint modes, optimizer,
clip, steps; and, with defaults that plain cases keep, the layers' naming, data-parallel replicas
and ZeRO level) through a :class:`Chooser`, so that hypothesis (which shrinks a failure to a small
case) and a seeded ``random.Random`` (a fixed sample for the multi-process test) drive the same
generator.

The data flowing between layers is tracked by its shape without the batch: ``(d,)``, ``(c, d)``,
or a pair of equal shapes (a tuple, which a ``merge`` layer adds back into one tensor).

A "dotted" case keys its layers "layers.0", "layers.1", ... (a ``keyed`` model, as
pipetrain.hf's "model.layers.0"): names that are no path of attributes, which torch resolves as
paths; its parameters are compared under the plain model's keys.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from pipetrain.layer_tree import LayerTree
from schedules.registry import RECOMPUTE_MODES, build, lookup, names
from tests.runtime.models import Branch, Halves, Keep, Merge, SharedAffine

T = TypeVar("T")

BATCH = 12  # divisible by every chunk count drawn (1-4)
LENGTH = 4  # the sequence length of (c, d) data, and the width most layers map to
VOCAB = 7  # token ids of an Embedding model
SCHEDULES = tuple(names(asynchronous=False))  # every synchronous schedule in the registry
OPTIMIZERS = ("sgd", "adamw")
CLIP = 0.5  # below the usual gradient norm here, so a clip on changes the step
# Norms divide by sqrt(variance + eps): after a ReLU a feature may be nearly constant, and the
# default eps (1e-5) then magnifies fp32 rounding 300-fold, to the 1e-5 tolerance itself (plain
# training in fp32 and fp64 differed by 1.4e-5); 1e-3 bounds the magnification to 30
NORM_EPS = 1e-3
SEED = 1234  # torch's seed before each Pipeline is built (the stages' random streams)

Shape = tuple[int, ...]


class Chooser(Protocol):
    """What the generator asks of its source of choices."""

    def integer(self, low: int, high: int) -> int:
        """An integer in [low, high]."""

    def choice(self, options: Sequence[T]) -> T:
        """One of ``options`` (hypothesis shrinks towards the first)."""


class RandomChooser:
    """Choices from a seeded ``random.Random``: a fixed sample of cases."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def integer(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]


# -- layers -------------------------------------------------------------------------------------


class Residual(nn.Module):
    """``x + relu(Linear(x))``."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(x))


class Detach(nn.Module):
    """Cuts the gradient: the layers before get none through here."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()


class Reshape(nn.Module):
    """(d,) -> (LENGTH, d / LENGTH), a view of the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], LENGTH, -1)


class Slice(nn.Module):
    """Drops the first feature of the last dimension: a view."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., 1:]


class Transpose(nn.Module):
    """(c, d) -> (d, c): a view."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


# -- tokens -------------------------------------------------------------------------------------

# token -> what it needs of its input: "any" tensor, "seq" (c, d), "vec" (d,), "pair"
NEEDS = {
    "linear": "any", "residual": "any", "layernorm": "any", "batchnorm": "any",
    "dropout": "any", "relu_": "any", "gelu": "any", "identity": "any", "detach": "any",
    "frozen": "any", "half_frozen": "any", "affine": "any", "branch": "any", "keep": "any",
    "halves": "any", "slice": "any",
    "conv": "seq", "flatten": "seq", "transpose": "seq",
    "reshape": "vec",
    "merge": "pair",
}
BODY = tuple(NEEDS)
# tokens whose module "again" may reuse
REUSABLE = ("linear", "conv", "residual", "layernorm", "batchnorm")
WEIGHTED = ("linear", "conv", "residual", "frozen", "half_frozen", "branch", "keep", "halves",
            "layernorm", "batchnorm", "affine", "embedding", "head")
VIEWS = ("flatten", "reshape", "slice", "transpose")  # what makes the next layer see a view
# drawn twice as often as the rest: what makes in-place ops meet views, shared Parameters and
# BatchNorm's running statistics updated twice
LIKELIER = ("relu_", "affine", "batchnorm", *VIEWS)
INPUT_SHAPES: tuple[Shape, ...] = ((LENGTH,), (LENGTH, LENGTH + 1))


@dataclass
class _Built:
    """The model under construction: its layers and the shape each takes and gives."""

    layers: list[nn.Module] = field(default_factory=list)
    shapes: list[tuple[Shape | None, Shape | None, bool]] = field(default_factory=list)
    shared: dict[int, tuple[nn.Parameter, nn.Parameter]] = field(default_factory=dict)
    embedding: nn.Embedding | None = None


def _accepts(token: str, shape: Shape, pair: bool) -> bool:
    """Whether ``token`` can follow data of ``shape`` (a pair of them if ``pair``)."""
    need = NEEDS[token]
    if pair:
        return need == "pair"
    if need == "pair":
        return False
    if need == "seq" and len(shape) != 2:
        return False
    if need == "vec" and (len(shape) != 1 or shape[0] % LENGTH or shape[0] < 2 * LENGTH):
        return False
    if token == "slice" and shape[-1] < 2:
        return False
    return True


def _make(token: str, shape: Shape, built: _Built) -> tuple[nn.Module, Shape, bool]:
    """The module of ``token`` for input ``shape``: (module, output shape, output is a pair)."""
    d = shape[-1]
    if token.startswith("again:"):
        index = int(token.split(":")[1])
        _, out, pair = built.shapes[index]
        assert out is not None
        return built.layers[index], out, pair
    if token == "linear":
        return nn.Linear(d, LENGTH), (*shape[:-1], LENGTH), False
    if token in ("frozen", "half_frozen"):
        layer = nn.Linear(d, LENGTH)
        layer.weight.requires_grad_(False)
        if token == "frozen":
            layer.bias.requires_grad_(False)
        return layer, (*shape[:-1], LENGTH), False
    if token == "conv":
        return nn.Conv1d(shape[0], shape[0], 3, padding=1), shape, False
    if token == "layernorm":
        return nn.LayerNorm(d, eps=NORM_EPS), shape, False
    if token == "batchnorm":
        return nn.BatchNorm1d(shape[0] if len(shape) == 2 else d, eps=NORM_EPS), shape, False
    if token == "affine":
        if d not in built.shared:
            built.shared[d] = (nn.Parameter(1 + 0.1 * torch.randn(d)),
                               nn.Parameter(0.1 * torch.randn(d)))
        return SharedAffine(*built.shared[d]), shape, False
    simple: dict[str, Callable[[], nn.Module]] = {
        "dropout": lambda: nn.Dropout(0.3), "relu_": lambda: nn.ReLU(inplace=True),
        "gelu": nn.GELU, "identity": nn.Identity, "detach": Detach, "merge": Merge,
    }
    if token in simple:
        return simple[token](), shape, False
    if token in ("residual", "branch", "keep", "halves"):
        kinds: dict[str, Callable[[int], nn.Module]] = {
            "residual": Residual, "branch": Branch, "keep": Keep, "halves": Halves,
        }
        return kinds[token](d), shape, token != "residual"
    if token == "flatten":
        return nn.Flatten(), (shape[0] * shape[1],), False
    if token == "reshape":
        return Reshape(), (LENGTH, d // LENGTH), False
    if token == "slice":
        return Slice(), (*shape[:-1], d - 1), False
    if token == "transpose":
        return Transpose(), (shape[1], shape[0]), False
    raise ValueError(f"unknown layer token {token!r}")


@dataclass(frozen=True)
class ModelSpec:
    """A model: the input's shape without the batch (empty for token ids) and the layer
    tokens. Build it with :func:`build_model`."""

    input_shape: Shape
    tokens: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.tokens)


DOTTED = "layers."  # a dotted case's layer i is keyed "layers.i"


def build_model(spec: ModelSpec, seed: int = 0, dotted: bool = False) -> nn.Sequential:
    """The model of ``spec``, its weights drawn from ``seed`` (the same in every process);
    ``dotted``: its layers keyed "layers.i" (module docstring)."""
    torch.manual_seed(seed)
    built = _Built()
    shape, pair = spec.input_shape, False
    for token in spec.tokens:
        if token == "embedding":
            layer: nn.Module = nn.Embedding(VOCAB, LENGTH)  # ids (LENGTH,) -> (LENGTH, LENGTH)
            built.embedding = layer  # type: ignore[assignment]
            out: Shape = (LENGTH, LENGTH)
        elif token == "head":
            assert built.embedding is not None and shape[-1] == LENGTH
            head = nn.Linear(LENGTH, VOCAB, bias=False)
            head.weight = built.embedding.weight
            layer, out = head, (*shape[:-1], VOCAB)
        else:
            layer, out, pair_out = _make(token, shape, built)
            built.layers.append(layer)
            built.shapes.append((shape, out, pair_out))
            shape, pair = out, pair_out
            continue
        built.layers.append(layer)
        built.shapes.append((shape, out, False))
        shape, pair = out, False
    assert not pair, "a model must end in a tensor"
    if dotted:
        return LayerTree([(f"{DOTTED}{i}", m) for i, m in enumerate(built.layers)])
    return nn.Sequential(*built.layers)


def output_shape(spec: ModelSpec) -> Shape:
    """The model's output shape without the batch."""
    model = build_model(spec)
    with torch.no_grad():
        return tuple(model(sample_input(spec, 0)).shape[1:])


def sample_input(spec: ModelSpec, step: int, batch: int = BATCH) -> torch.Tensor:
    """Step ``step``'s input: token ids for an Embedding model, else floats."""
    g = torch.Generator().manual_seed(100 + step)
    if spec.tokens[0] == "embedding":
        return torch.randint(0, VOCAB, (batch, LENGTH), generator=g)
    return torch.randn(batch, *spec.input_shape, generator=g)


def draw_model(choose: Chooser, most: int = 8, leave_out: frozenset[str] = frozenset()
               ) -> ModelSpec:
    """Between 2 and ``most`` + 2 layers, each valid for the data its predecessor gives;
    none of the tokens in ``leave_out`` ("again" for modules used twice)."""
    tokens: list[str] = []
    if "embedding" not in leave_out and choose.integer(0, 3) == 3:
        tokens.append("embedding")
        input_shape: Shape = ()
        shape: Shape = (LENGTH, LENGTH)
    else:
        input_shape = shape = choose.choice(INPUT_SHAPES)
    pair = False
    # (token index, input shape, output shape, pair) of each reusable module so far
    reusable: list[tuple[int, Shape, Shape]] = []
    for _ in range(choose.integer(1, most)):
        again = [f"again:{i}" for i, given, _ in reusable
                 if given == shape and not pair and "again" not in leave_out]
        options = [t for t in BODY if _accepts(t, shape, pair) and t not in leave_out]
        options += [t for t in options if t in LIKELIER]
        if tokens and tokens[-1] == "flatten" and "reshape" in options and choose.integer(0, 2):
            options = ["reshape"]  # a view of a view, two times in three: else rare (flat data)
        elif tokens and tokens[-1] in VIEWS and "relu_" in options and choose.integer(0, 2) == 2:
            options = ["relu_"]  # an in-place op on a view: one time in three after a view
        elif again and choose.integer(0, 3) == 3:
            options = again  # a module used before: one time in four where one fits
        token = choose.choice(options)
        if token.startswith("again:"):
            index = int(token.split(":")[1])
            out = next(o for i, _, o in reusable if i == index)
            pair_out = False
        else:
            _, out, pair_out = _make(token, shape, _Built())
        if token in REUSABLE:
            reusable.append((len(tokens), shape, out))
        tokens.append(token)
        shape, pair = out, pair_out
    if pair:
        tokens.append("merge")
    if "embedding" in tokens and choose.integer(0, 2):  # a tied head two times in three
        if shape[-1] != LENGTH:
            tokens.append("linear")
        tokens.append("head")
    else:
        tokens.append("linear")  # a trainable last layer: the loss always has a gradient
    return ModelSpec(input_shape, tuple(tokens))


# -- the training set-up ------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One model trained one way: compared with plain single-process training."""

    model: ModelSpec
    balance: tuple[int, ...]
    schedule: str
    ranks: int  # devices (threads) or processes; fewer than stages under "interleaved"
    chunks: int
    checkpoint: tuple[str, ...]  # per stage
    optimizer: str
    clip: float | None
    steps: int
    dotted: bool = False  # layers keyed "layers.i"
    replicas: int = 1  # data-parallel replicas of each stage (ranks x replicas processes)
    zero: int = 0
    reduce_scatter: str = "step"  # at zero 2/3: once per mini-batch, or "microbatch"

    def stages(self) -> list[range]:
        """Each stage's layer positions."""
        bounds = [0]
        for size in self.balance:
            bounds.append(bounds[-1] + size)
        return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def _split(choose: Chooser, layers: int, stages: int) -> tuple[int, ...]:
    """A random balance: ``stages`` positive sizes summing to ``layers``."""
    cuts = sorted(choose_distinct(choose, range(1, layers), stages - 1))
    bounds = [0, *cuts, layers]
    return tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))


def choose_distinct(choose: Chooser, pool: range, count: int) -> list[int]:
    left = list(pool)
    picked = []
    for _ in range(count):
        picked.append(left.pop(choose.integer(0, len(left) - 1)))
    return picked


def draw_case(choose: Chooser, ranks: int | None = None, most_layers: int = 8,
              leave_out: frozenset[str] = frozenset(), schedules: Sequence[str] = SCHEDULES,
              most_stages: int = 4) -> Case:
    """A case; ``ranks`` fixes the number of devices (processes), else 1-``most_stages``
    stages; ``leave_out`` and ``schedules`` narrow the space (to hunt one defect at a time)."""
    model = draw_model(choose, most_layers, leave_out)
    layers = len(model)
    schedule = choose.choice([  # a V's two stages per rank need enough layers
        s for s in schedules if (lookup(s).stages_per_rank or 1) * (ranks or 1) <= layers
    ])
    if lookup(schedule).multi_stage_per_rank:
        fixed = lookup(schedule).stages_per_rank  # a V's 2
        placed = ranks if ranks is not None else choose.integer(1, 2)
        if fixed is not None:
            placed = min(placed, min(most_stages, layers) // fixed)
        most = max(min(most_stages, layers) // placed, 1)
        stages = placed * (fixed or choose.integer(min(2 if placed == 1 else 1, most), most))
        chunks = placed * choose.integer(1, 4 // placed)
        chunks = max(chunks, lookup(schedule).least_microbatches(stages))  # DualPipeV: m >= 2p
    else:
        stages = ranks if ranks is not None else choose.integer(1, min(most_stages, layers))
        placed = stages
        chunks = choose.integer(1, 4)
    checkpoint = tuple(choose.choice(RECOMPUTE_MODES) for _ in range(stages))
    optimizer = choose.choice(OPTIMIZERS)
    clip = choose.choice((None, CLIP))
    steps = choose.integer(1, 3)
    return Case(model, _split(choose, layers, stages), schedule, placed, chunks, checkpoint,
                optimizer, clip, steps)


def make_optimizer(name: str) -> Callable[[Any], torch.optim.Optimizer]:
    """SGD with momentum, or AdamW with eps=1e-3: see test_equivalence.py's docstring."""
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return lambda params: torch.optim.AdamW(params, lr=0.01, eps=1e-3, weight_decay=0.1)


# -- training: the pipeline and plain single-process training -----------------------------------


def data(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's (input, target): MSE targets of the output's shape."""
    shape = output_shape(case.model)
    g = torch.Generator().manual_seed(7)
    return [(sample_input(case.model, step), torch.randn(BATCH, *shape, generator=g))
            for step in range(case.steps)]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def train_pipeline(case: Case, devices: bool = True, timeout: float = 30.0) -> dict[str, Any]:
    """The case trained by a Pipeline (stages as threads if ``devices``, else this process's
    rank of a process group): this rank's parameters (full-model keys) and the losses."""
    import pipetrain

    model = build_model(case.model, dotted=case.dotted)
    torch.manual_seed(SEED)
    pipe = pipetrain.Pipeline(
        model, list(case.balance), chunks=case.chunks, schedule=case.schedule,
        recompute=list(case.checkpoint), loss_fn=loss_fn,
        optimizer=make_optimizer(case.optimizer), clip_grad_norm=case.clip,
        deferred_batch_norm=True, timeout=timeout, replicas=case.replicas, zero=case.zero,
        reduce_scatter=case.reduce_scatter,
        devices=["cpu"] * case.ranks if devices else None,
    )
    share = BATCH // case.replicas  # this replica's rows of each mini-batch
    rows = slice(pipe.placement.replica * share, (pipe.placement.replica + 1) * share)
    losses = [float(pipe.train_step(x[rows].clone(), y[rows])) for x, y in data(case)]
    state = {key.removeprefix(DOTTED) if case.dotted else key: whole(value)
             for key, value in pipe.module.state_dict().items()}
    return {"state": state, "losses": losses}


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A ZeRO shard's whole tensor (a collective over the stage's replicas), else itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def train_reference(case: Case) -> dict[str, Any]:
    """Plain training in this process: the micro-batches' gradients summed (each loss divided
    by the micro-batch count), clipped over the whole model, one optimizer step a mini-batch.

    Stage s's layers draw their random numbers (dropout) from a stream of their own seeded as
    the Pipeline seeds stage s's (pipetrain/runtime/rng.py), so the masks are the pipeline's;
    and each micro-batch is normalised by BatchNorm with its own statistics, as under
    ``deferred_batch_norm`` (whose running statistics, those of the whole mini-batch, are not
    compared: test_batchnorm.py checks them)."""
    from pipetrain.runtime.rng import draw_seeds

    model = build_model(case.model)
    torch.manual_seed(SEED)
    streams = [torch.Generator().manual_seed(s).get_state() for s in draw_seeds(len(case.balance))]
    optimizer = make_optimizer(case.optimizer)(model.parameters())
    losses = []
    for x, y in data(case):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for xm, ym in zip(x.clone().chunk(case.chunks), y.chunk(case.chunks), strict=True):
            value: Any = xm
            for s, positions in enumerate(case.stages()):
                outside = torch.get_rng_state()
                torch.set_rng_state(streams[s])
                for i in positions:
                    value = model[i](value)
                streams[s] = torch.get_rng_state()
                torch.set_rng_state(outside)
            loss = loss_fn(value, ym) / case.chunks
            loss.backward()
            total += loss.item()
        if case.clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        optimizer.step()
        losses.append(total)
    return {"state": model.state_dict(), "losses": losses}


def norm_across_ranks(case: Case) -> bool:
    """Whether one BatchNorm runs on stages of two ranks: deferred_batch_norm refuses that
    (tests/runtime/test_batchnorm_reuse.py checks the refusal)."""
    ranks = case.ranks if lookup(case.schedule).multi_stage_per_rank else None
    schedule = build(case.schedule, len(case.balance), case.chunks, ranks=ranks)
    rank_of = {i: schedule.rank_of(s) for s, positions in enumerate(case.stages())
               for i in positions}
    model = build_model(case.model)
    return any(model[i] is model[j] and isinstance(model[i], nn.BatchNorm1d)
               and rank_of[i] != rank_of[j]
               for i in range(len(model)) for j in range(i + 1, len(model)))


def is_statistic(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")


def largest_difference(per_rank: Sequence[dict[str, Any]],
                       expected: dict[str, Any]) -> tuple[float, str]:
    """The largest absolute difference of any parameter or loss from plain training, and
    where; every parameter key must be held by some rank."""
    worst, where = 0.0, ""
    held: set[str] = set()
    for result in per_rank:
        for key, value in result["state"].items():
            held.add(key)
            if is_statistic(key):
                continue
            diff = (value.float() - expected["state"][key].float()).abs().max().item()
            if not diff <= worst:  # NaN counts as the largest
                worst, where = diff, key
    for got, want in zip(per_rank[-1]["losses"], expected["losses"], strict=True):
        if not abs(got - want) <= worst:
            worst, where = abs(got - want), "loss"
    missing = sorted(set(expected["state"]) - held)
    if missing:
        return float("inf"), f"{where} differs by {worst:.3g} and no rank holds {missing}"
    return worst, where


# -- what a case exercises ----------------------------------------------------------------------

TOKEN_FEATURES = {
    "linear": "Linear", "conv": "Conv1d", "head": "Embedding with a tied head",
    "layernorm": "LayerNorm", "batchnorm": "BatchNorm (deferred)", "dropout": "Dropout",
    "relu_": "in-place ReLU", "gelu": "GELU", "flatten": "reshape: Flatten",
    "reshape": "reshape: view", "slice": "reshape: slice", "transpose": "reshape: transpose",
    "detach": "detached path", "frozen": "frozen layer", "half_frozen": "frozen parameter",
    "branch": "layer returning a tuple", "keep": "layer returning its own input",
    "identity": "layer returning its own input", "halves": "layer returning views",
    "residual": "residual block", "affine": "Parameter shared by modules",
}


def features(case: Case) -> set[str]:
    """The vocabulary and set-up a case exercises (the long profile counts them)."""
    tokens = case.model.tokens
    found = {TOKEN_FEATURES[t] for t in tokens if t in TOKEN_FEATURES}
    stage_of = {i: s for s, positions in enumerate(case.stages()) for i in positions}
    starts = {positions[0] for positions in case.stages()}
    for i, token in enumerate(tokens):
        if token != "relu_":
            continue
        if i > 0 and tokens[i - 1] in VIEWS:
            found.add("in-place after a view")
        if i in starts and i > 0:
            found.add("in-place at a stage's start")
        if i == 0:
            found.add("in-place first layer")
    model = build_model(case.model)
    for i in range(len(model)):
        for j in range(i + 1, len(model)):
            where = "one stage" if stage_of[i] == stage_of[j] else "two stages"
            if model[i] is model[j]:
                found.add(f"module used twice in {where}")
                if isinstance(model[i], nn.BatchNorm1d):
                    found.add(f"BatchNorm used twice in {where}")
            elif any(p is q for p in model[i].parameters() for q in model[j].parameters()):
                found.add(f"Parameter shared in {where}")
                if tokens[j] == "head":
                    found.add(f"tied head in {where}")
    found |= {
        f"schedule {case.schedule}", f"{len(case.balance)} stage(s)", f"chunks {case.chunks}",
        f"optimizer {case.optimizer}", "clip on" if case.clip else "clip off",
        f"{case.steps} step(s)", *(f"checkpoint {mode}" for mode in case.checkpoint),
        "dotted layer names" if case.dotted else "positional layer names",
    }
    if len(case.balance) > case.ranks:
        found.add("several stages per rank")
    return found


def model_of(tokens: Sequence[str], input_shape: Sequence[int] = ()) -> nn.Sequential:
    """:func:`build_model` by plain arguments: a factory for ``pipetrain profile --kwargs``."""
    return build_model(ModelSpec(tuple(input_shape), tuple(tokens)))
