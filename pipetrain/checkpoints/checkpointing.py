"""Checkpoints a crash cannot corrupt, keyed by the full model so they load under any balance.

Layout of ``folder``::

    latest                      the name of the newest complete checkpoint (replaced atomically)
    step-00000010/manifest.json format, step, stage count, the run that saved it
    step-00000010/stage-0.pt    stage 0: module state, optimizer state by parameter name, RNG,
                                the LR schedule's state and fp16's loss scale (if any)

A save writes into ``step-N.partial``; each file goes to a temporary name, is fsynced and renamed;
only when every stage's file is there does the coordinator rename the folder to ``step-N``, fsync
and point ``latest`` at it. A crash anywhere leaves the previous checkpoint whole and ``latest``
naming it. Loading reads only with ``torch.load(weights_only=True)``.

Resuming takes the checkpoint ``latest`` names if it is complete, else the newest complete one
(with a warning); a folder with step folders but no complete checkpoint is refused, never
silently trained over from step 0. A damaged stage file is refused naming it and the newest
intact checkpoint.

Each run has an identity, recorded in the manifest of every checkpoint it saves; a run resumed
from a checkpoint takes on its identity (it goes on with that run). Pruning removes only the
pruning run's own older checkpoints: never another run's (nor one without an identity, from an
older pipetrain), never one saved after the checkpoint the run resumed from.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import uuid
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from pipetrain.checkpoints import layout, weightfile
from pipetrain.errors import CheckpointError
from pipetrain.training.compensation import Compensator
from pipetrain.training.precision import LossScaler
from pipetrain.training.weights import WeightVersions

FORMAT = "pipetrain-checkpoint"
VERSION = 1
class _StateDict(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> None: ...


class Stage(Protocol):
    """What a checkpoint saves and restores of a stage (runtime/stage.py's ``Stage``): read
    through this protocol so that checkpoints, below the runtime, never import it."""

    @property
    def index(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def module(self) -> torch.nn.Module: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...
    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None: ...
    @property
    def rng(self) -> _StateDict: ...
    @property
    def versions(self) -> WeightVersions | None: ...


KEEP = 2  # complete checkpoints kept; older ones are removed after a successful save
_NAME = re.compile(r"step-\d{8,}(\.\d{4})?")  # a checkpoint's folder (``latest`` names one)
# a stage's module and optimizer state_dicts, whole, gathered from its sharded replicas
WholeState = tuple[dict[str, Any], dict[str, Any] | None]
# the whole tensors by name (module, optimizer state) -> a sharded stage's shares of them
S = TypeVar("S", bound=Stage)
Shard = Callable[[S, dict[str, Any], dict[str, Any]], tuple[dict[str, Any], dict[str, Any]]]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _parameter_names(stage: Stage) -> dict[int, str]:
    return {id(p): name for name, p in stage.module.named_parameters()}


def _optimizer_state(stage: Stage, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The optimizer's state (``state``: its state_dict as gathered from sharded replicas) with
    parameters named, not numbered, so it re-slices."""
    if stage.optimizer is None:
        return {}
    names = _parameter_names(stage)
    order = [names[id(p)] for g in stage.optimizer.param_groups for p in g["params"]]
    state = state if state is not None else stage.optimizer.state_dict()
    return {
        "state": {order[i]: s for i, s in state["state"].items()},
        "param_groups": [
            {**_hyper(g), "params": [order[i] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def _saver(payload: dict[str, Any]) -> Callable[[Path], None]:
    return lambda path: torch.save(payload, path)


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _compensator(stage: Stage) -> Compensator | None:
    return stage.versions.compensator if stage.versions is not None else None


def _compensation_state(stage: Stage) -> dict[str, Any] | None:
    compensator = _compensator(stage)
    return compensator.state_dict() if compensator is not None else None


def _rng_state(stage: Stage) -> dict[str, Any]:
    """The process's generators and the stage's own stream (pipetrain/runtime/rng.py)."""
    state = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]),
        "stage": stage.rng.state_dict(),
    }
    if stage.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(stage.device)
    return state


def save(
    folder: str | os.PathLike[str],
    step: int,
    stages: Sequence[Stage],
    barrier: Callable[[], None],
    coordinator: bool,
    num_stages: int,
    scaler: LossScaler | None = None,
    protect: Collection[str] = (),
    run: str | None = None,
    whole: Sequence[WholeState] | None = None,
) -> Path:
    """Write a checkpoint of ``stages`` (this process's) at ``step``. Every process of the
    pipeline calls it; ``barrier`` waits for all of them; the ``coordinator`` publishes it as
    a checkpoint of ``run`` (a fresh identity when None) and prunes that run's old
    checkpoints, never those named in ``protect``. ``whole``: per stage, its module and
    optimizer state_dicts gathered from its sharded replicas (pipetrain/runtime/sharding.py)
    in place of the stage's own."""
    run = run or new_run()
    root = Path(folder)
    final = _fresh_name(root, step)
    partial = final.with_name(final.name + ".partial")
    if coordinator:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step-*.partial"):  # left by a crash during an earlier save
            shutil.rmtree(stale, ignore_errors=True)
        partial.mkdir()
    barrier()
    for i, stage in enumerate(stages):
        module, optimizer = whole[i] if whole is not None else (stage.module.state_dict(), None)
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "stage": stage.index,
            "module": module,
            "optimizer": _optimizer_state(stage, optimizer),
            "rng": _rng_state(stage),
            "scheduler": stage.scheduler.state_dict() if stage.scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "compensation": _compensation_state(stage),
        }
        target = partial / f"stage-{stage.index}.pt"
        _write_atomically(target, _saver(payload))
    barrier()
    if coordinator:
        files = sorted(partial.glob("stage-*.pt"))
        if len(files) != num_stages:
            raise RuntimeError(f"checkpoint {partial} has {len(files)} of {num_stages} stage files")
        manifest = {
            "format": FORMAT, "version": VERSION, "step": step, "stages": num_stages, "run": run,
        }
        _write_atomically(partial / "manifest.json", lambda p: p.write_text(json.dumps(manifest)))
        os.replace(partial, final)
        _fsync_dir(root)
        _write_atomically(root / "latest", lambda p: p.write_text(final.name))
        _prune(root, final, protect, run)
    barrier()
    return final


def new_run() -> str:
    """A fresh run identity."""
    return uuid.uuid4().hex


def run_of(path: Path) -> str | None:
    """The identity of the run that saved the checkpoint at ``path`` (None: unknown, e.g. an
    older pipetrain's checkpoint, or an unreadable manifest)."""
    try:
        run = json.loads((path / "manifest.json").read_text()).get("run")
    except (OSError, ValueError, AttributeError):
        return None
    return run if isinstance(run, str) else None


def _prune(root: Path, keep: Path, protect: Collection[str], run: str) -> None:
    """Remove all but the KEEP most recently saved checkpoints of ``run``, never ``keep`` (the
    one ``latest`` names), and every other checkpoint of ``run`` at ``keep``'s step, which it
    supersedes (a step saved again leaves one checkpoint of it). Save order is the manifests'
    write order, not the step number: a run restarted from scratch saves small steps after
    large ones. Never another run's checkpoints, nor those in ``protect`` (saved after the one
    this run resumed from)."""
    complete = [p for p in _complete(root) if run_of(p) == run]
    step = keep.name.partition(".")[0]
    superseded = [p for p in complete if p != keep and p.name.partition(".")[0] == step]
    complete = [p for p in complete if p not in superseded]
    for old in superseded + complete[:-KEEP]:
        if old != keep and old.name not in protect:
            shutil.rmtree(old, ignore_errors=True)


def _fresh_name(root: Path, step: int) -> Path:
    """``step-N``, or ``step-N.K`` if a checkpoint of that step exists: an existing checkpoint
    (perhaps the one ``latest`` names) is never overwritten."""
    name = root / f"step-{step:08d}"
    again = 1
    while name.exists():
        name = root / f"step-{step:08d}.{again:04d}"
        again += 1
    return name


def _steps(root: Path) -> list[Path]:
    """The step folders of ``root`` (finished or not; never a save's ``.partial`` leftovers)."""
    return [p for p in root.glob("step-*") if p.is_dir() and _NAME.fullmatch(p.name)]


def _complete(root: Path) -> list[Path]:
    """The complete checkpoints of ``root``, oldest first in save order (the manifests' write
    order, as pruning counts: a run restarted from scratch saves small steps after large ones)."""
    done = [p for p in _steps(root) if (p / "manifest.json").is_file()]
    return sorted(done, key=lambda p: (p / "manifest.json").stat().st_mtime_ns)


def latest(folder: str | os.PathLike[str]) -> Path | None:
    """The checkpoint to resume from: the one ``latest`` names when it is complete, else the
    newest complete one (with a warning). None for a folder without checkpoints (a fresh
    start); CheckpointError when it has step folders but none is complete."""
    root = Path(folder)
    pointer = root / "latest"
    named = pointer.read_text().strip() if pointer.is_file() else None
    if named and _NAME.fullmatch(named) and (root / named / "manifest.json").is_file():
        return root / named
    complete = _complete(root)
    if not complete:
        if _steps(root):
            raise CheckpointError(
                f"{root} holds step folders but no complete checkpoint (each lacks its "
                "manifest.json); restore one from a backup, or train from scratch in an empty "
                "folder"
            )
        return None
    why = f"{pointer} names {named!r}, which is not a complete checkpoint" if named else (
        f"{pointer} is missing"
    )
    warnings.warn(
        f"{why}: using {complete[-1].name}, the newest complete checkpoint in {root}",
        stacklevel=2,
    )
    return complete[-1]


def saved_after(path: Path) -> frozenset[str]:
    """The complete checkpoints next to ``path`` saved after it: a run resumed from ``path``
    never prunes them (they may hold later work, e.g. when a crash came before ``latest``
    was updated)."""
    mine = (path / "manifest.json").stat().st_mtime_ns
    return frozenset(
        p.name for p in _complete(path.parent) if (p / "manifest.json").stat().st_mtime_ns > mine
    )


def _read_stage(file: Path, device: torch.device, mmap: bool = False) -> dict[str, Any]:
    """One stage file (memory-mapped with ``mmap``: its pages are read when used), or a
    CheckpointError naming it and what is wrong with it."""
    if not file.is_file():
        raise CheckpointError(f"{file} is missing")
    try:
        payload = torch.load(file, map_location=device, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:  # weights_only refused an object: nothing in it was run
        payload = None
    except Exception as error:  # a truncated or garbled file fails anywhere in torch.load
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{file} is damaged (truncated or overwritten?): {first}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(
            f"{file} is not a pipetrain checkpoint: it holds objects that pipetrain never "
            "writes, so it was refused unread"
        )
    return payload


def _stage_files(path: Path) -> list[Path]:
    """The stage files the manifest of the checkpoint at ``path`` promises, in stage order."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path / 'manifest.json'} is unreadable: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or (
        manifest.get("version") != VERSION
    ):
        raise CheckpointError(f"{path} is not a pipetrain checkpoint of version {VERSION}")
    return [path / f"stage-{s}.pt" for s in range(manifest["stages"])]


def _read_checkpoint(path: Path, device: torch.device) -> list[dict[str, Any]]:
    return [_read_stage(file, device) for file in _stage_files(path)]


def _load_files(path: Path, device: torch.device) -> list[dict[str, Any]]:
    """Every stage file of the checkpoint at ``path``; a damaged one is refused naming it and
    the newest intact checkpoint of the folder."""
    try:
        return _read_checkpoint(path, device)
    except CheckpointError as error:
        others = [p for p in reversed(_complete(path.parent)) if p != path]
        intact = next((p for p in others if _is_intact(p)), None)
        way_out = (
            f"the newest intact checkpoint is {intact.name}: delete {path} to resume from it"
            if intact else f"no other intact checkpoint is in {path.parent}"
        )
        raise CheckpointError(f"{error}; {way_out}") from None


def _is_intact(path: Path) -> bool:
    try:
        _read_checkpoint(path, torch.device("cpu"))
    except CheckpointError:
        return False
    return True


def consolidate(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The newest checkpoint in ``folder`` (or the checkpoint ``folder`` itself) as one plain
    state_dict of the original model."""
    merged: dict[str, torch.Tensor] = {}
    for payload in _load_files(_checkpoint(folder), torch.device("cpu")):  # the model's order
        merged.update(payload["module"])
    return merged


def consolidate_safetensors(folder: str | os.PathLike[str], output: str | os.PathLike[str]) -> int:
    """Write the newest checkpoint in ``folder`` as one safetensors file of the whole model
    (keys as in its state_dict), one stage at a time: each stage file is memory-mapped, its
    tensors written, and it is let go before the next, so the whole model is never in memory.
    Returns the number of tensors."""
    index: layout.Index = {}
    for module in module_states(folder):  # the header first: every tensor's dtype and shape
        index.update({k: (v.dtype, tuple(v.shape)) for k, v in module.items()})

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for module in module_states(folder):
            yield from module.items()

    weightfile.write_safetensors(output, index, tensors())
    return len(index)


def module_states(folder: str | os.PathLike[str]) -> Iterator[dict[str, torch.Tensor]]:
    """The model's state_dict in the newest checkpoint of ``folder``, one stage's at a time,
    in stage order, memory-mapped (pages are read when a tensor is used)."""
    for file in _stage_files(_checkpoint(folder)):
        yield _read_stage(file, torch.device("cpu"), mmap=True)["module"]


def _checkpoint(folder: str | os.PathLike[str]) -> Path:
    """The checkpoint ``folder`` is, or the newest in it; a CheckpointError if none."""
    root = Path(folder)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a folder; pass a checkpoint folder")
    path = root if (root / "manifest.json").is_file() else latest(root)
    if path is None:
        raise CheckpointError(
            f"{root} holds no checkpoint; pass the folder given to Pipeline(checkpoint_dir=...) "
            "or Pipeline.save"
        )
    return path


def load(
    folder: str | os.PathLike[str], stages: Sequence[S], scaler: LossScaler | None = None,
    shard: Shard[S] | None = None,
) -> tuple[int, Path] | None:
    """Restore ``stages`` (and ``scaler``) from the newest checkpoint in ``folder`` (made under
    any balance, replicas or ``zero``); return its step and path, or None when there is none
    yet. ``shard`` turns the whole tensors into a sharded stage's shares
    (pipetrain/runtime/sharding.py)."""
    path = latest(folder)
    if path is None:
        return None
    payloads = _load_files(path, stages[0].device)
    modules: dict[str, torch.Tensor] = {}
    optimizer_state: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    for payload in payloads:
        modules.update(payload["module"])
        optimizer_state.update(payload["optimizer"].get("state", {}))
        groups += payload["optimizer"].get("param_groups", [])
    for stage in stages:
        if shard is not None:  # sharded replicas: each keeps its shards of the whole tensors
            modules, optimizer_state = shard(stage, modules, optimizer_state)
        _restore_stage(stage, modules, optimizer_state, groups, path)
    by_stage = {payload["stage"]: payload for payload in payloads}
    for stage in stages:  # every stage's schedule is at the same step: any file will do
        saved = by_stage.get(stage.index, payloads[0]).get("scheduler")
        if stage.scheduler is not None and saved is not None:
            stage.scheduler.load_state_dict(saved)
    for stage in stages:  # PipeMare's warm-up and moving average go on where they stopped
        saved, compensator = by_stage.get(stage.index, {}).get("compensation"), _compensator(stage)
        if compensator is not None and saved is not None:
            compensator.load_state_dict(saved)
    if scaler is not None and payloads[0].get("scaler") is not None:
        scaler.load_state_dict(payloads[0]["scaler"])
    _set_rng(by_stage.get(stages[0].index, payloads[0])["rng"], stages[0].device)
    for stage in stages:  # a stage's stream goes on where its namesake's stopped
        saved = by_stage.get(stage.index, {}).get("rng", {}).get("stage")
        if saved is not None:
            stage.rng.load_state_dict(saved)
    return int(payloads[0]["step"]), path


def _set_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _restore_stage(
    stage: Stage, modules: dict[str, Any], optimizer_state: dict[str, Any],
    groups: list[dict[str, Any]], path: Path,
) -> None:
    wanted = stage.module.state_dict().keys()
    missing = sorted(set(wanted) - modules.keys())
    if missing:
        raise ValueError(
            f"checkpoint {path} was made for another model: stage {stage.index} needs "
            f"{missing[:5]}{' …' if len(missing) > 5 else ''}, which it lacks; load a checkpoint "
            "of this model"
        )
    stage.module.load_state_dict({k: modules[k] for k in wanted})
    if stage.optimizer is None:
        return
    names = _parameter_names(stage)
    order = [names[id(p)] for g in stage.optimizer.param_groups for p in g["params"]]
    by_name = {n: g for g in groups for n in g["params"]}
    param_groups, start = [], 0
    for group in stage.optimizer.param_groups:  # numbered as the optimizer's state_dict does
        numbers = list(range(start, start + len(group["params"])))
        start += len(numbers)
        saved = by_name.get(order[numbers[0]]) if numbers else None
        param_groups.append({**_hyper(saved or group), "params": numbers})
    state = {i: optimizer_state[n] for i, n in enumerate(order) if n in optimizer_state}
    stage.optimizer.load_state_dict({"state": state, "param_groups": param_groups})


class Checkpoints:
    """What a pipeline knows of its own checkpoints: its run's identity (fresh, or that of the
    checkpoint it resumed from), the step and checkpoint it last saved or loaded (saving that
    step again in the same folder returns it), and the checkpoints saved after the one it
    resumed from (kept from pruning)."""

    def __init__(self) -> None:
        self.protected: frozenset[str] = frozenset()
        self.last: tuple[int, Path] | None = None
        self.run = new_run()  # this run's identity: only the coordinator's is ever written

    def save(
        self, folder: str | os.PathLike[str], step: int, stages: Sequence[Stage],
        barrier: Callable[[], None], coordinator: bool, num_stages: int,
        scaler: LossScaler | None, whole: Sequence[WholeState] | None = None,
    ) -> Path:
        """:func:`save`, unless this pipeline's checkpoint of ``step`` is in ``folder`` and
        still complete (the same answer on every rank)."""
        if self.last is not None:
            saved, path = self.last
            same = saved == step and path.parent.resolve() == Path(folder).resolve()
            if same and (path / "manifest.json").is_file():
                return path
        path = save(
            folder, step, stages, barrier, coordinator, num_stages, scaler, self.protected,
            self.run, whole,
        )
        self.last = (step, path)
        return path

    def load(
        self, folder: str | os.PathLike[str], stages: Sequence[S], scaler: LossScaler | None,
        shard: Shard[S] | None = None,
    ) -> int | None:
        """:func:`load`; the step restored, or None when there is no checkpoint yet."""
        resumed = load(folder, stages, scaler, shard)
        if resumed is None:
            return None
        step, path = resumed
        self.protected = saved_after(path)
        self.last = (step, path)
        self.run = run_of(path) or self.run  # this run goes on with the one it resumed
        return step
