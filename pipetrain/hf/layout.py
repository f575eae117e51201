"""A Hugging Face checkpoint's keys as the model's, by transformers' own conversions.

transformers renames some keys and converts some tensors when it loads a checkpoint
(``from_pretrained``), and converts them back when it saves one (``save_pretrained``): a
mixture-of-experts block holds all its experts in one fused tensor, while the hub, and
``save_pretrained``, write one tensor per expert; GPT-NeoX's head, ``lm_head`` in the model,
is ``embed_out`` in Pythia's checkpoints. :class:`HubLayout` applies the same transforms, the
ones transformers lists for the model (``get_model_conversion_mapping``), grouped the same
way its loader groups them: each key renamed, and the keys a converter takes together made
into its targets by the converter itself. transformers 4.56 converts no tensors (its mixtures
of experts hold one tensor per expert, as the hub does): there each key is renamed as its
``from_pretrained`` renames it (pipetrain/hf/compat.py). Nothing here knows a model: what
transformers knows is all there is.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from pipetrain.checkpoints.layout import Group, Index
from pipetrain.hf import compat


class HubLayout:
    """The layout (pipetrain/checkpoints/layout.py) of ``model``'s Hugging Face checkpoints,
    by transformers' conversions of that model (its ``from_pretrained``'s, legacy names
    included); :meth:`to_hub` is the way back (its ``save_pretrained``'s)."""

    def __init__(self, model: Any):
        self.model = model

    def groups(self, index: Index) -> list[Group]:
        """The groups of ``index``: a key that no converter takes is kept or renamed; the keys
        a converter takes are one group, with the targets that converting them on the meta
        device gives."""
        if not compat.converts_checkpoints():
            names = compat.renamed_keys(self.model, list(index))
            return [Group({key: index[key]}, {names[key]: index[key]}) for key in index]
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        transforms = get_model_conversion_mapping(self.model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        keys = dict.fromkeys(self.model.state_dict())
        prefix = self.model.base_model_prefix
        groups: list[Group] = []
        fused: dict[str, list[tuple[str, str]]] = {}  # first target -> (file key, pattern)
        for key in sorted(index, key=dot_natural_key):
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, keys)
            if renamed not in keys and key in keys:  # as transformers: kept, not renamed
                renamed, pattern = key, None
            if pattern is None or renamed not in keys:
                groups.append(Group({key: index[key]}, {renamed: index[key]}))
            else:
                fused.setdefault(renamed, []).append((key, pattern))
        for first, sources in fused.items():
            make = _Converted(by_pattern[sources[0][1]], first, sources, self.model)
            meta = {key: torch.empty(index[key][1], dtype=index[key][0], device="meta")
                    for key, _ in sources}
            targets = {k: (v.dtype, tuple(v.shape)) for k, v in make(meta).items()}
            groups.append(Group({key: index[key] for key, _ in sources}, targets, make))
        return groups

    def to_hub(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (some of the model's keys: whole layers) in the keys and tensors
        ``save_pretrained`` writes (on the meta device: their shapes)."""
        if not compat.converts_checkpoints():
            return compat.keys_on_save(self.model, state)
        from transformers.core_model_loading import revert_weight_conversion

        return dict(revert_weight_conversion(self.model, dict(state)))


class _Converted:
    """Make a converter's targets from its file keys' tensors, as transformers' loader does:
    a fresh copy of the converter is given the tensors in the file's key order."""

    def __init__(self, converter: Any, first: str, sources: list[tuple[str, str]], model: Any):
        self.converter, self.first, self.sources, self.model = converter, first, sources, model

    def __call__(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        converter = copy.deepcopy(self.converter)
        for key, pattern in self.sources:
            converter.add_tensor(self.first, key, pattern, tensors[key])
        made = converter.convert(self.first, model=self.model, config=self.model.config)
        return {k: v[0] if isinstance(v, list) else v for k, v in made.items()}
