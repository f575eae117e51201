"""This process's layers of the model: where they come from and where they go.

A Pipeline's stages here get their layers in one of three ways, chosen by ``LayerSource``:
a model built eagerly is moved to each stage's device (optionally re-initialized first by the
per-layer rule, ``init_seed``); a model built on the meta device has only this process's layers
materialized, on their devices, and initialized by the rule (pipetrain/training/lazy.py); and with
``weights`` (a whole-model safetensors or .pt file, or a Hugging Face checkpoint directory)
each stage reads its own tensors from the file, checked against the whole model's keys and
shapes first, the same check on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipetrain.checkpoints import weightfile
from pipetrain.layer_tree import LayerTree
from pipetrain.training.lazy import InitFn, init_layers, is_meta, materialize


@dataclass(frozen=True)
class LayerSource:
    """How layers get their values: the rule's seed and function, and a weights file."""

    init_seed: int | None = None
    init: InitFn | None = None
    weights: str | os.PathLike[str] | None = None

    def check(self, model: LayerTree) -> None:
        """Refuse, before any process group is made, what cannot give the layers values; read
        the weights file's index and check it against the model."""
        if self.init_seed is not None and not isinstance(self.init_seed, int):
            raise TypeError(f"init_seed must be an int, got {self.init_seed!r}")
        if self.init is not None and self.init_seed is None:
            raise ValueError("init= runs per layer from a seed: pass init_seed=... with it")
        if is_meta(model) and self.init_seed is None and self.weights is None:
            raise ValueError(
                "the model is on the meta device (shapes only, no data): pass init_seed=... "
                "(each rank initializes its own layers, layer i from the seed and i) or "
                "weights=... (a safetensors or .pt file of the whole model's state_dict)"
            )
        if self.weights is not None:
            weightfile.reading(self.weights, model)

    def settings(self) -> dict[str, object]:
        """What every rank must agree on (for the start-up fingerprint)."""
        return {"init_seed": self.init_seed, "weights": str(self.weights or "")}

    def bring_up(
        self, model: LayerTree, parts: Sequence[tuple[int, LayerTree]],
        devices: Mapping[int, torch.device],
    ) -> dict[int, torch.Tensor]:
        """Stage s (of ``devices``, stage -> device) on its device with its values. Returns
        the tensors that replaced meta ones, by the meta tensor's id."""
        made: dict[int, torch.Tensor] = {}
        plan = None
        if self.weights is not None:  # before materializing: tied tensors are still shared
            plan = weightfile.reading(self.weights, model, check=False)
        if is_meta(model):
            where = {
                offset + i: devices[s]
                for s, (offset, module) in enumerate(parts) if s in devices
                for i in range(len(module))
            }
            skip = [i for i in where if self.weights is not None and not _unsaved(model[i])]
            made = materialize(model, where, self.init_seed, self.init, skip)
        elif self.init_seed is not None:  # every rank alike: the whole model, then its share
            init_layers(model, self.init_seed, self.init)
        for s, device in devices.items():  # and a meta model's tensors that were not meta
            parts[s][1].to(device)
        if plan is not None:
            for s in devices:
                weightfile.load_into(plan.path, parts[s][1], plan)
        return made


def _unsaved(layer: nn.Module) -> bool:
    """Whether ``layer`` has buffers outside its state_dict still on the meta device (a file
    cannot restore them; one that already holds its value, as pipetrain.hf.sequential gives
    them, needs nothing)."""
    return any(
        buffer is not None and buffer.is_meta
        for module in layer.modules() for name, buffer in module._buffers.items()
        if name in module._non_persistent_buffers_set
    )
