"""What differs between the transformers releases pipetrain.hf supports (4.56 through 5.x).

Each shim names the release that needs it; the rest of pipetrain/hf calls these and never asks
for a version. Where a release cannot do what pipetrain needs, the shim refuses it, naming the
release that can.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

NEWER = "transformers>=5.20"  # what a refusal here asks for: the oldest 5.x that CI runs


def version() -> str:
    """The installed transformers' version."""
    import transformers

    return str(transformers.__version__)


@functools.cache
def before_5() -> bool:
    """Whether the installed transformers is a 4.x release (4.56), which the shims below
    marked 4.56 are for; on 5.x they change nothing."""
    return int(version().split(".")[0]) < 5


def converts_checkpoints() -> bool:
    """Whether transformers converts a checkpoint's tensors as it loads one (5.x:
    ``transformers.conversion_mapping``); 4.56 only renames keys (:func:`renamed_keys`)."""
    return importlib.util.find_spec("transformers.conversion_mapping") is not None


def renamed_keys(model: Any, keys: list[str]) -> dict[str, str]:
    """4.56 (no conversion mapping): each checkpoint key as the model's key, renamed as 4.56's
    ``from_pretrained`` renames it (``_get_key_renaming_mapping``: legacy names, the base
    model's prefix added to a base model's checkpoint, a VLM class's key mapping)."""
    prefix = model.base_model_prefix
    has_prefix = bool(prefix) and any(k.startswith(prefix) for k in keys)
    expects_prefix = bool(prefix) and hasattr(model, prefix)
    mapping = model._get_key_renaming_mapping(
        keys, model._checkpoint_conversion_mapping if _vlm(model) else None,
        has_prefix and not expects_prefix, expects_prefix and not has_prefix)
    return {key: mapping.get(key, key) for key in keys}


def _vlm(model: Any) -> bool:
    """4.56: whether ``from_pretrained`` and ``save_pretrained`` apply ``model``'s class key
    mapping (``_checkpoint_conversion_mapping``): a class named as one of its VLMS."""
    from transformers import modeling_utils

    names = getattr(modeling_utils, "VLMS", ())
    return any(name in c.__name__.lower() for c in type(model).__mro__[:-1] for name in names)


def keys_on_save(model: Any, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """4.56 (no conversion mapping): ``state`` under the keys 4.56's ``save_pretrained``
    writes (``_fix_state_dict_keys_on_save``; a VLM's key mapping reversed)."""
    saved = dict(model._fix_state_dict_keys_on_save(dict(state)))
    if not _vlm(model):
        return saved
    back = {v: re.sub(r"\(.*\)", "", k.lstrip("^"))
            for k, v in model._checkpoint_conversion_mapping.items()}
    renamed = {}
    for key, tensor in saved.items():
        for pattern, replacement in back.items():
            key, count = re.subn(pattern, replacement, key)
            if count:
                break
        renamed[key] = tensor
    return renamed


def rotary_on_meta(rotary: nn.Module, hidden: torch.Tensor, *rest: Any) -> Any:
    """4.56: rotary modules run under ``torch.autocast`` of their input's device type, which
    the meta device lacks; on meta the cos/sin (shapes only) are computed on the CPU from
    empty inputs of the same shapes and returned as meta tensors."""
    cpu = [torch.zeros_like(r, device="cpu") if isinstance(r, torch.Tensor) else r
           for r in rest]
    made = rotary.to("cpu")(torch.empty_like(hidden, device="cpu"), *cpu)
    return tuple(t.to("meta") for t in made)


def meta_refusal(block: nn.Module, error: Exception) -> TypeError | None:
    """4.56: mixtures of experts route tokens by value (``nonzero``, an expert picked by a
    tensor's value), which the meta device cannot run; 5.x's grouped experts run there. The
    error to raise for ``block`` failing on meta with ``error``; None on 5.x (``error``
    stands)."""
    if not before_5():
        return None
    return TypeError(
        f"{type(block).__name__} cannot run on the meta device with transformers {version()} "
        f"({type(error).__name__}: {error!s:.120}): on 4.x a block that routes tokens by value "
        f"(a mixture of experts) has no meta run; profile it without --meta, or install {NEWER}"
    )


class _Writes(TorchDispatchMode):
    """The storages that in-place operations write while it is on."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.written: set[int] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        for argument, value in zip(func._schema.arguments, args, strict=False):
            info = argument.alias_info
            if info is not None and info.is_write and isinstance(value, torch.Tensor):
                self.written.add(value.untyped_storage().data_ptr())
        return func(*args, **kwargs)


def init_weights(model: Any, module: nn.Module) -> None:
    """``model._init_weights(module)``, each tensor it writes counted as written (its version
    raised). 4.56's rules write through ``tensor.data``, which leaves the tensor's version as
    it was, so pipetrain would take the tensor for one the rule left unwritten."""
    if not before_5():
        model._init_weights(module)
        return
    with _Writes() as writes:
        model._init_weights(module)
    for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
        if not tensor.is_meta and tensor.untyped_storage().data_ptr() in writes.written:
            torch.autograd.graph.increment_version(tensor)


# 4.56: flags a block's forward takes whose defaults are what the pipeline runs (Qwen2-MoE's
# output_router_logits, False: no auxiliary loss, as the model's default)
BLOCK_FLAGS = frozenset({"output_router_logits"})


def base_model(model: Any) -> nn.Module:
    """``model``'s base model: ``model.base_model``, or, where its ``base_model_prefix`` names
    no child (4.56's Gemma3ForCausalLM: "language_model", holding it as ``model``), its one
    child that is a transformers model."""
    from transformers import PreTrainedModel

    found: nn.Module = model.base_model
    if found is model:
        models = [m for m in model.children() if isinstance(m, PreTrainedModel)]
        found = models[0] if len(models) == 1 else model
    return found


def block_parameters(block: nn.Module) -> frozenset[str] | None:
    """The keywords ``block``'s forward takes, None where it takes any (4.56: GPT-Neo's blocks
    take no ``position_ids``; their positions are added with the embedding)."""
    parameters = inspect.signature(type(block).forward).parameters
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return None
    return frozenset(parameters)


# 4.56: Gemma 3's blocks take a global and a local rotary table, both made by the base model
# (5.x: one table per layer type, which pipetrain makes per block)
_TWO_TABLES = ("position_embeddings_global", "position_embeddings_local")


def refusal(model: Any, base: nn.Module, blocks: nn.ModuleList) -> TypeError | None:
    """The error for a model that this transformers lays out where pipetrain cannot cut it,
    and a newer one does not; None where there is none. 4.56's Gemma scales its embeddings in
    the base model's forward, outside the modules (5.x: in the embedding module); 4.56's
    Gemma 3 blocks take rotary tables made outside them (``_TWO_TABLES``)."""
    if not before_5():
        return None
    why = None
    try:
        scales = "normalizer" in inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        scales = False
    if scales:
        why = "its base model's forward scales the embeddings outside the modules"
    elif any(name in inspect.signature(type(b).forward).parameters
             for b in blocks for name in _TWO_TABLES):
        why = f"its blocks take {', '.join(_TWO_TABLES)}, made by the base model's forward"
    if why is None:
        return None
    return TypeError(f"{type(model).__name__} with transformers {version()}: {why}, which "
                     f"pipetrain.hf.sequential does not reproduce; install {NEWER}")


def rebuild_buffers(config: Any, blocks: nn.ModuleList) -> None:
    """4.56: GPT-2's and GPT-Neo's attention make their causal-mask buffers in ``__init__``
    (Qwen2-MoE's attention a rotary table of its own), outside the state_dict, and no
    ``_init_weights`` rule makes them; on a meta model each block's are taken from a block of
    its class built on the CPU as its base model builds it, ``(config, layer index)``. A block
    that cannot be built so keeps them meta (pipetrain then names them)."""
    if not before_5():
        return
    for index, block in enumerate(blocks):
        metas = [name for name, tensor in block.named_buffers() if tensor.is_meta
                 and name.rpartition(".")[2] in block.get_submodule(
                     name.rpartition(".")[0])._non_persistent_buffers_set]
        if not metas:
            continue
        try:
            with torch.device("cpu"):
                fresh = dict(type(block)(config, index).named_buffers())
        except TypeError:
            continue
        for name in metas:
            owner, _, leaf = name.rpartition(".")
            block.get_submodule(owner)._buffers[leaf] = fresh[name]
