"""Checkpoints a crash cannot corrupt, keyed by the full model so they load under any balance.

Layout of ``folder``::

    latest                      the name of the newest complete checkpoint (replaced atomically)
    step-00000010/manifest.json format, step, stage count, every stage's parameter keys
    step-00000010/stage-0.pt    stage 0: module state, optimizer state by parameter name, RNG,
                                the LR schedule's state and fp16's loss scale (if any)

A save writes into ``step-N.partial``; each file goes to a temporary name, is fsynced and renamed;
only when every stage's file is there does the coordinator rename the folder to ``step-N``, fsync
and point ``latest`` at it. A crash anywhere leaves the previous checkpoint whole and ``latest``
naming it. Loading reads only with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pipetrain.precision import LossScaler
from pipetrain.stage import Stage

FORMAT = "pipetrain-checkpoint"
VERSION = 1
KEEP = 2  # complete checkpoints kept; older ones are removed after a successful save


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


def _optimizer_state(stage: Stage) -> dict:
    """The optimizer's state with parameters named, not numbered, so it re-slices."""
    if stage.optimizer is None:
        return {}
    names = _parameter_names(stage)
    order = [names[id(p)] for g in stage.optimizer.param_groups for p in g["params"]]
    state = stage.optimizer.state_dict()
    return {
        "state": {order[i]: s for i, s in state["state"].items()},
        "param_groups": [
            {**_hyper(g), "params": [order[i] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def _saver(payload: dict) -> Callable[[Path], None]:
    return lambda path: torch.save(payload, path)


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save(
    folder: str | os.PathLike,
    step: int,
    stages: Sequence[Stage],
    barrier: Callable[[], None],
    coordinator: bool,
    num_stages: int,
    scaler: LossScaler | None = None,
) -> Path:
    """Write a checkpoint of ``stages`` (this process's) at ``step``. Every process of the
    pipeline calls it; ``barrier`` waits for all of them; the ``coordinator`` publishes."""
    root = Path(folder)
    final = _fresh_name(root, step)
    partial = final.with_name(final.name + ".partial")
    if coordinator:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step-*.partial"):  # left by a crash during an earlier save
            shutil.rmtree(stale, ignore_errors=True)
        partial.mkdir()
    barrier()
    for stage in stages:
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "stage": stage.index,
            "module": stage.module.state_dict(),
            "optimizer": _optimizer_state(stage),
            "rng": _rng_state(stage.device),
            "scheduler": stage.scheduler.state_dict() if stage.scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
        }
        target = partial / f"stage-{stage.index}.pt"
        _write_atomically(target, _saver(payload))
    barrier()
    if coordinator:
        files = sorted(partial.glob("stage-*.pt"))
        if len(files) != num_stages:
            raise RuntimeError(f"checkpoint {partial} has {len(files)} of {num_stages} stage files")
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "stages": num_stages}
        _write_atomically(partial / "manifest.json", lambda p: p.write_text(json.dumps(manifest)))
        os.replace(partial, final)
        _fsync_dir(root)
        _write_atomically(root / "latest", lambda p: p.write_text(final.name))
        _prune(root, keep=final)
    barrier()
    return final


def _prune(root: Path, keep: Path) -> None:
    """Remove all but the KEEP most recently saved checkpoints, never ``keep`` (the one
    ``latest`` names). Save order is the manifests' write order, not the step number: a run
    restarted from scratch saves small steps after large ones."""
    complete = [p for p in root.glob("step-*") if (p / "manifest.json").exists()]
    complete.sort(key=lambda p: (p / "manifest.json").stat().st_mtime_ns)
    for old in complete[:-KEEP]:
        if old != keep:
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


def latest(folder: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``folder``, or None if there is none."""
    pointer = Path(folder) / "latest"
    if not pointer.exists():
        return None
    path = Path(folder) / pointer.read_text().strip()
    if not (path / "manifest.json").exists():
        raise RuntimeError(f"{pointer} names {path.name}, which is incomplete; delete {pointer}")
    return path


def _load_files(path: Path, device: torch.device) -> list[dict]:
    manifest = json.loads((path / "manifest.json").read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{path} is not a pipetrain checkpoint of version {VERSION}")
    return [
        torch.load(path / f"stage-{s}.pt", map_location=device, weights_only=True)
        for s in range(manifest["stages"])
    ]


def consolidate(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The newest checkpoint in ``folder`` as one plain state_dict of the original model."""
    path = latest(folder) or Path(folder)
    merged: dict[str, torch.Tensor] = {}
    for payload in _load_files(path, torch.device("cpu")):  # in stage order: the model's order
        merged.update(payload["module"])
    return merged


def load(
    folder: str | os.PathLike, stages: Sequence[Stage], scaler: LossScaler | None = None
) -> int | None:
    """Restore ``stages`` (and ``scaler``) from the newest checkpoint in ``folder`` (made under
    any balance); return its step, or None when there is none yet."""
    path = latest(folder)
    if path is None:
        return None
    payloads = _load_files(path, stages[0].device)
    modules: dict[str, torch.Tensor] = {}
    optimizer_state: dict[str, dict] = {}
    groups: list[dict] = []
    for payload in payloads:
        modules.update(payload["module"])
        optimizer_state.update(payload["optimizer"].get("state", {}))
        groups += payload["optimizer"].get("param_groups", [])
    for stage in stages:
        _restore_stage(stage, modules, optimizer_state, groups, path)
    by_stage = {payload["stage"]: payload for payload in payloads}
    for stage in stages:  # every stage's schedule is at the same step: any file will do
        saved = by_stage.get(stage.index, payloads[0]).get("scheduler")
        if stage.scheduler is not None and saved is not None:
            stage.scheduler.load_state_dict(saved)
    if scaler is not None and payloads[0].get("scaler") is not None:
        scaler.load_state_dict(payloads[0]["scaler"])
    _set_rng(by_stage.get(stages[0].index, payloads[0])["rng"], stages[0].device)
    return int(payloads[0]["step"])


def _set_rng(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _restore_stage(
    stage: Stage, modules: dict, optimizer_state: dict, groups: list[dict], path: Path
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
    current = stage.optimizer.state_dict()
    order = [names[id(p)] for g in stage.optimizer.param_groups for p in g["params"]]
    by_name = {n: g for g in groups for n in g["params"]}
    param_groups = []
    for group in current["param_groups"]:
        saved = by_name.get(order[group["params"][0]]) if group["params"] else None
        param_groups.append({**_hyper(saved or group), "params": group["params"]})
    state = {i: optimizer_state[n] for i, n in enumerate(order) if n in optimizer_state}
    stage.optimizer.load_state_dict({"state": state, "param_groups": param_groups})
