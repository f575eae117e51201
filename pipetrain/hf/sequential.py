"""A Hugging Face causal LM as pipetrain's layers, named by their paths in the model.

``sequential(model)`` lays a ``*ForCausalLM`` out as a LayerTree (pipetrain/layer_tree.py)
whose layers are the model's own modules under their own paths: the modules before the blocks
("model.embed_tokens"; GPT-2's "transformer.wte", "transformer.wpe", "transformer.drop"), one
layer per decoder block ("model.layers.0", ...), the final norm ("model.norm"), the output head
("lm_head"). So ``state_dict()`` has the model's keys: an HF checkpoint loads into it and a
pipeline's checkpoint is an HF checkpoint's contents. How each layer is called on what crosses
a stage boundary is its glue (:class:`Embed`, :class:`Block`, ...), outside the parameter tree.

What crosses a stage boundary is the flat tuple ``(hidden_states, attention_mask,
position_ids)``: the 2-D padding mask (1 for a token, 0 for padding) and the positions travel
with the activations. The blocks build the 4-D attention mask from them with transformers'
own mask functions (causal, or sliding-window as the model's forward picks it; "eager" and
"sdpa" alike) and the rotary cos/sin from the positions, once per stage's forward
(:class:`Shared`); rotary tables are buffers outside the state_dict, so they are computed on
each rank's device, never loaded.

The first stage takes ``input_ids`` or ``(input_ids, attention_mask)`` (or ``(input_ids,
attention_mask, position_ids)``); the last layer returns the logits.

For generation (``Pipeline.generate``) the layers decode incrementally
(pipetrain/runtime/decoding.py): each step carries only the new tokens' hidden states and
positions, with the mask of the whole sequence, and the blocks of a stage keep their keys and
values in a cache of that stage's micro-batch (pipetrain/hf/cache.py), the 4-D mask built for
the cache by the same mask functions.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipetrain.hf import compat
from pipetrain.hf.cache import OneLayer, cache_argument, stage_cache
from pipetrain.hf.layout import HubLayout
from pipetrain.layer_tree import Glue, LayerTree
from pipetrain.runtime.decoding import DecodeState

Boundary = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # hidden, mask, positions


class CausalLMLayers(LayerTree):
    """The layers of a Hugging Face causal LM, named as in the model (see the module
    docstring); a slice keeps the names. ``checkpoint_layout``: how its hub checkpoints' keys
    become its own (pipetrain/hf/layout.py)."""

    checkpoint_layout: HubLayout


def sequential(model: Any) -> CausalLMLayers:
    """``model`` (a transformers ``*ForCausalLM``, built eagerly or on the meta device) as
    pipetrain's layers, sharing its parameters: embedding, one layer per decoder block, final
    norm, head. Architectures whose config declares ``base_model_pp_plan`` (Llama, Mistral,
    Qwen2/3 and others) and GPT-2 are understood; anything else is refused, naming why."""
    config = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if config is None or head is None:
        raise TypeError(
            f"pipetrain.hf.sequential takes a transformers *ForCausalLM (a model with a config "
            f"and an output head), got {type(model).__name__}"
        )
    base_module = compat.base_model(model)
    bases = [(n, m) for n, m in model.named_children() if m is base_module]
    heads = [n for n, m in model.named_children() if m is head]
    seq2seq = getattr(config, "is_encoder_decoder", False)
    if seq2seq or len(bases) != 1 or len(heads) != 1:
        why = "an encoder-decoder" if seq2seq else "its base model and head are not its children"
        raise TypeError(
            f"pipetrain.hf.sequential takes a causal LM (a decoder stack under an output head, "
            f"as *ForCausalLM), and {type(model).__name__} is not one ({why}): load it with "
            "AutoModelForCausalLM, or build an nn.Sequential by hand"
        )
    _refuse_extras(config)
    (base_name, base), (head_name,) = bases[0], heads
    before, layers_name, norm_name, rotary = _parts(model, config, base)
    positions = Positions(rotary, base.config) if rotary is not None else None
    shared = Shared()
    blocks = getattr(base, layers_name)
    old = compat.refusal(model, base, blocks)
    if old is not None:
        raise old
    _refuse_block_inputs(blocks)
    layers: list[tuple[str, nn.Module]] = []
    glue: dict[str, Glue] = {}
    for index, name in enumerate(before):
        layers.append((f"{base_name}.{name}", getattr(base, name)))
        glue[f"{base_name}.{name}"] = (Embed() if index == 0 else AddPositions()
                                       if name == "wpe" else OnHidden())
    for index, block in enumerate(blocks):
        layers.append((f"{base_name}.{layers_name}.{index}", block))
        glue[layers[-1][0]] = Block(*_mask_function(config, index, base), config, positions,
                                    (index, _layer_type(config, index)), shared, block)
    layers.append((f"{base_name}.{norm_name}", getattr(base, norm_name)))
    glue[layers[-1][0]] = Final()
    layers.append((head_name, head))
    made = CausalLMLayers(layers, glue)
    made.checkpoint_layout = HubLayout(model)
    _make_unsaved(model, made)
    compat.rebuild_buffers(base.config, blocks)
    return made


def _parts(
    model: Any, config: Any, base: nn.Module,
) -> tuple[list[str], str, str, nn.Module | None]:
    """Where to cut ``base``: the names of its modules before the blocks (the token embedding
    first), of its block stack and final norm, and its rotary module, from the config's
    ``base_model_pp_plan`` (embedding entries, the blocks, the norm) or GPT-2's modules;
    refused, saying what the plan holds and lacks."""
    plan = list(getattr(config, "base_model_pp_plan", None) or ())
    stacks = [n for n in plan if isinstance(getattr(base, n, None), nn.ModuleList)]
    if len(stacks) == 1 and plan.index(stacks[0]) == len(plan) - 2:
        # what comes before the blocks: the token embedding, then (Phi) its dropout
        return plan[:-2], plan[-2], plan[-1], getattr(base, "rotary_emb", None)
    if not plan and all(hasattr(base, n) for n in ("wte", "wpe", "h", "ln_f")):  # GPT-2
        return ["wte", "wpe", "drop"], "h", "ln_f", None
    if not plan:
        why = "its config declares no base_model_pp_plan and it is not GPT-2"
    elif len(stacks) != 1:
        held = f"{len(stacks)} block stacks, {stacks}" if stacks else "no block stack"
        why = (f"its config's base_model_pp_plan lists {plan}: {held} (an nn.ModuleList of "
               f"{type(base).__name__}) where one is needed")
    else:
        after = plan[plan.index(stacks[0]) + 1:]
        held = f"{len(after)} entries, {after}," if after else "nothing"
        why = (f"its config's base_model_pp_plan lists {plan}: after the blocks "
               f"{stacks[0]!r} it needs one entry, the final norm, and has {held}")
    raise TypeError(
        f"{type(model).__name__}: {why}, so pipetrain cannot tell where to cut it (embedding, "
        "blocks, final norm); pass a model whose config has such a plan (Llama, Mistral, "
        "Qwen2/3, ...) or build an nn.Sequential by hand"
    )


# what Block passes a block (or the block does not need: no cross-attention in a causal LM)
_CARRIED = {"self", "hidden_states", "attention_mask", "position_ids", "position_embeddings",
            "use_cache", "cache", "past_key_values", "past_key_value", "layer_past",
            "cache_position", "output_attentions", "head_mask", "encoder_hidden_states",
            "encoder_attention_mask"}


def _refuse_block_inputs(blocks: nn.ModuleList) -> None:
    """Refuse blocks whose forward takes inputs beyond those :class:`Block` gives (Gemma 3n
    and 4: per-layer inputs and key/value states shared across layers, which the base model
    computes outside the blocks and the stage boundary does not carry)."""
    carried = _CARRIED | compat.BLOCK_FLAGS
    for block in blocks:
        signature = inspect.signature(type(block).forward)
        extra = [n for n, p in signature.parameters.items()
                 if n not in carried and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        if extra:
            raise TypeError(
                f"{type(block).__name__} (a block) takes {', '.join(extra)}: inputs its model "
                "makes outside the blocks (per-layer inputs, states shared across layers), "
                "which pipetrain.hf.sequential does not carry between stages"
            )


def _make_unsaved(model: Any, layers: nn.Module) -> None:
    """Give the meta-device buffers outside the state_dict (Gemma's ``embed_scale``) their
    values now, on the CPU, by transformers' own rule from the config (``_init_weights``): no
    checkpoint holds them, so a meta model loaded with ``weights=DIR`` gets them only so (the
    pipeline moves them to the layer's device). One the rule leaves unwritten stays meta."""
    for module in layers.modules():
        metas = {n: b for n, b in module._buffers.items()
                 if n in module._non_persistent_buffers_set and b is not None and b.is_meta}
        if not metas:
            continue
        fresh = {n: torch.empty_like(b, device="cpu") for n, b in metas.items()}
        module._buffers.update(fresh)
        with torch.no_grad():
            compat.init_weights(model, module)
        for name, tensor in fresh.items():
            if tensor._version == 0:
                module._buffers[name] = metas[name]


def initializer(model: Any) -> Callable[[nn.Module], None]:
    """``init`` for ``Pipeline(layers, init_seed=..., init=initializer(model))``: each layer
    initialized by the model's own rule (transformers' ``_init_weights`` of every module in
    it), so a model built on the meta device from a config trains from the weights
    transformers would give it (drawn per layer from pipetrain's seed: any split alike)."""

    def init(layer: nn.Module) -> None:
        for module in layer.modules():
            compat.init_weights(model, module)

    return init


def _refuse_extras(config: Any) -> None:
    """Refuse the architectures whose forward scales the embeddings or the logits outside
    the modules (the layers would not reproduce it)."""
    extras = [
        name for name in ("final_logit_softcapping", "logit_scale", "logits_scaling",
                          "embedding_multiplier")
        if getattr(config, name, None) not in (None, 1, 1.0)
    ]
    if extras:
        raise TypeError(
            f"{type(config).__name__} sets {', '.join(extras)}: its forward scales the "
            "embeddings or the logits outside their modules, which pipetrain.hf.sequential does "
            "not reproduce"
        )


def _inputs(value: object) -> Boundary:
    """The first stage's input as (input_ids, attention_mask, position_ids), filling in an
    all-ones mask and positions 0..T-1 where absent."""
    given = list(value) if isinstance(value, tuple | list) else [value]
    members = [m for m in given if isinstance(m, torch.Tensor)]
    if not 1 <= len(given) <= 3 or len(members) != len(given):
        raise TypeError(
            "the first stage takes input_ids or (input_ids, attention_mask) or (input_ids, "
            f"attention_mask, position_ids), tensors of shape (batch, seq); got {value!r:.100}"
        )
    ids = members[0]
    if ids.dim() != 2 or ids.is_floating_point():
        raise ValueError(f"input_ids must be integer token ids of shape (batch, seq), got "
                         f"{ids.dtype} of shape {tuple(ids.shape)}")
    mask = members[1] if len(members) > 1 else torch.ones_like(ids)
    if len(members) > 2:
        positions = members[2]
    else:
        positions = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)
    for what, tensor in (("attention_mask", mask), ("position_ids", positions)):
        if tuple(tensor.shape) != tuple(ids.shape):
            raise ValueError(f"{what} has shape {tuple(tensor.shape)}, input_ids "
                             f"{tuple(ids.shape)}: pass one value per token")
    return ids, mask, positions


class Embed:
    """The token embedding's glue: the first stage's input (see :func:`_inputs`) in, the
    boundary tuple out."""

    def __call__(self, layer: nn.Module, value: object) -> Boundary:
        ids, mask, positions = _inputs(value)
        return layer(ids), mask, positions

    def decode(self, layer: nn.Module, value: Boundary, state: DecodeState) -> Boundary:
        """A generation step: the new tokens (batch, new), the mask of the whole sequence
        (batch, past + new) and the new tokens' positions (pipetrain/runtime/decoding.py)."""
        ids, mask, positions = value
        return layer(ids), mask, positions


class AddPositions:
    """GPT-2's learned position table's glue: adds the positions' rows to the hidden states."""

    def __call__(self, layer: nn.Module, value: Boundary) -> Boundary:
        hidden, mask, positions = value
        return hidden + layer(positions), mask, positions

    def decode(self, layer: nn.Module, value: Boundary, state: DecodeState) -> Boundary:
        return self(layer, value)


class OnHidden:
    """The glue of a module between the embedding and the blocks (a dropout): it runs on the
    hidden states, the mask and positions pass by."""

    def __call__(self, layer: nn.Module, value: Boundary) -> Boundary:
        hidden, mask, positions = value
        return layer(hidden), mask, positions

    def decode(self, layer: nn.Module, value: Boundary, state: DecodeState) -> Boundary:
        return self(layer, value)


class Final:
    """The final norm's glue: takes the boundary tuple, returns the normalized hidden states."""

    def __call__(self, layer: nn.Module, value: Boundary) -> torch.Tensor:
        return layer(value[0])  # type: ignore[no-any-return]

    def decode(self, layer: nn.Module, value: Boundary, state: DecodeState) -> torch.Tensor:
        return self(layer, value)


class Positions:
    """Rotary cos/sin from position ids, with a copy of the model's rotary module per device
    (its tables are buffers outside the state_dict: computed from the config, never loaded;
    a meta-device model's are rebuilt here)."""

    def __init__(self, rotary: nn.Module, config: Any):
        with torch.device("cpu"):  # GPT-J's and CodeGen's keep no config of their own
            self.rotary = type(rotary)(config=getattr(rotary, "config", config))
        self.copies: dict[torch.device, nn.Module] = {}
        self.per_type = "layer_type" in inspect.signature(rotary.forward).parameters

    def __call__(
        self, hidden: torch.Tensor, positions: torch.Tensor, layer_type: str | None,
    ) -> Any:
        rest = (layer_type,) if layer_type is not None and self.per_type else ()
        if hidden.is_meta and compat.before_5():  # 4.56's rotary modules autocast on meta
            return compat.rotary_on_meta(self.rotary, hidden, positions, *rest)
        rotary = self.copies.get(hidden.device)
        if rotary is None:
            rotary = self.copies.setdefault(hidden.device, copy.deepcopy(self.rotary).to(
                hidden.device))
        return rotary(hidden, positions, *rest)  # Gemma 3: a table per attention type


class Shared:
    """What the blocks derive alike from the mask and positions that travel (the 4-D mask of
    each attention kind, the rotary cos/sin): the first block of a stage's forward computes
    it, the next blocks reuse it (the same mask tensor passes through a stage's blocks), and
    it is dropped with that mask. Stages in threads share it, hence the lock (re-entrant: a
    mask may be collected, and forgotten here, while the lock is held)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._entries: dict[int, tuple[weakref.ref[torch.Tensor], dict[Any, Any]]] = {}

    def get(
        self, mask: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, what: object,
        make: Callable[[], Any],
    ) -> Any:
        key = (what, hidden.dtype, hidden.device)
        with self._lock:
            entry = self._entries.get(id(mask))
            if entry is None or entry[0]() is not mask:
                entry = (weakref.ref(mask), {})
                self._entries[id(mask)] = entry
                weakref.finalize(mask, self._forget, id(mask), entry[1])
            hit = entry[1].get(key)
            if hit is not None and hit[0] is positions:
                return hit[1]
        value = make()
        with self._lock:
            entry[1][key] = (positions, value)
        return value

    def __reduce__(self) -> tuple[type[Shared], tuple[()]]:
        return Shared, ()  # a copy (deepcopy, pickle) starts empty, with a lock of its own

    def _forget(self, key: int, values: dict[Any, Any]) -> None:
        with self._lock:
            if key in self._entries and self._entries[key][1] is values:
                del self._entries[key]


class Block:
    """A decoder block's glue: builds its attention mask and rotary embedding from the mask
    and positions that travel with the hidden states (or takes them from an earlier block of
    the stage, :class:`Shared`), runs the block, passes them on."""

    mask_kind: str
    mask: Callable[..., Any]
    config: Any
    positions: Positions | None
    index: int  # its place in the stack: its attention's layer number in a cache
    layer_type: str | None
    shared: Shared
    cache_name: str | None  # the name its forward takes a cache by (pipetrain/hf/cache.py)
    takes: frozenset[str] | None  # the keywords its forward takes; None: any

    def __init__(
        self, mask_kind: str, mask: Callable[..., Any], config: Any,
        positions: Positions | None, place: tuple[int, str | None], shared: Shared,
        block: nn.Module,
    ):
        self.mask_kind, self.mask, self.config = mask_kind, mask, config
        self.positions, self.index, self.layer_type = positions, place[0], place[1]
        self.shared = shared
        self.cache_name = cache_argument(block)
        self.takes = compat.block_parameters(block)

    def __call__(self, layer: nn.Module, value: Boundary) -> Boundary:
        return self._run(layer, value, None)

    def decode(self, layer: nn.Module, value: Boundary, state: DecodeState) -> Boundary:
        """A generation step on the new tokens: keys and values of the earlier ones come
        from the stage's cache of this micro-batch (pipetrain/hf/cache.py), which this block
        extends with its own."""
        if self.cache_name is None:
            raise TypeError(f"{type(layer).__name__} takes no cache: it cannot generate "
                            "incrementally")
        return self._run(layer, value, stage_cache(state, self.shared, self.config))

    def _run(self, layer: nn.Module, value: Boundary, cache: Any) -> Boundary:
        """The block on ``value``; with ``cache``, one generation step (its 4-D mask sized
        against this block's entry of the cache, before the block extends it)."""
        hidden, mask, positions = value
        extra: dict[str, Any] = {}
        rotary = self.positions
        if rotary is not None:
            extra["position_embeddings"] = self.shared.get(
                mask, positions, hidden, ("rotary", self.layer_type),
                lambda: rotary(hidden, positions, self.layer_type),
            )
        attention = self.shared.get(
            mask, positions, hidden, ("mask", self.mask_kind, cache is not None),
            lambda: self.mask(self.config, hidden, mask, positions, cache, self.index),
        )
        if cache is not None:
            extra[self.cache_name] = cache  # type: ignore[index]
        meta = _MetaKernels() if hidden.is_meta else None  # type: ignore[no-untyped-call]
        try:
            with meta or contextlib.nullcontext():
                out = layer(hidden, **self._taken(attention_mask=attention,
                                 position_ids=positions, use_cache=cache is not None, **extra))
        except (RuntimeError, NotImplementedError) as error:
            refusal = None if meta is None else compat.meta_refusal(layer, error)
            if refusal is None:
                raise
            raise refusal from error
        if isinstance(out, tuple):  # blocks of older transformers return (hidden, ...)
            out = out[0]
        return out, mask, positions

    def _taken(self, **arguments: Any) -> dict[str, Any]:
        """The ``arguments`` the block's forward takes (pipetrain/hf/compat.py)."""
        if self.takes is None:
            return arguments
        return {k: v for k, v in arguments.items() if k in self.takes}


class _MetaKernels(TorchDispatchMode):
    """Shapes on the meta device where torch's meta kernel is narrower than its real ones:
    ``_grouped_mm`` (transformers' mixture-of-experts layers) takes float32 on the CPU and
    CUDA but only bfloat16 on meta, so its meta output's shape is the bfloat16 one's, in the
    dtype the real kernel gives."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if str(func) == "aten._grouped_mm.default" and args[0].dtype != torch.bfloat16:
            dtype = kwargs.get("out_dtype") or args[0].dtype
            cast = [a.to(torch.bfloat16) if i < 2 else a for i, a in enumerate(args)]
            return func(*cast, **{**kwargs, "out_dtype": None}).to(dtype)
        return func(*args, **kwargs)


def transformers_module() -> Any:
    """transformers, or an error saying how to install it (the ``hf`` extra)."""
    try:
        import transformers
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "pipetrain.hf needs transformers: pip install 'pipetrain[hf]'"
        ) from None
    return transformers


def _layer_type(config: Any, index: int) -> str | None:
    types = getattr(config, "layer_types", None)
    return None if types is None else str(types[index])


def _slides(base: nn.Module) -> bool:
    """Whether ``base``'s forward builds sliding-window masks (read from its source, the one
    place that says so for a config without layer types)."""
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        raise TypeError(
            f"{type(base).__name__} has a sliding window in its config, no layer types, and no "
            "source to tell whether its forward uses the window; pipetrain.hf.sequential "
            "cannot pick its attention mask"
        ) from None
    return "create_sliding_window_causal_mask" in source


def _mask_function(
    config: Any, index: int, base: nn.Module,
) -> tuple[str, Callable[..., Any]]:
    """Block ``index``'s kind of mask and its 4-D mask builder, as its model's forward picks
    them: by the config's layer types where it has them, else sliding-window where the config
    sets a window and ``base``'s forward builds sliding-window masks (Mistral's; some configs
    store a window their model never uses), else causal."""
    masking_utils = transformers_module().masking_utils
    types = getattr(config, "layer_types", None)
    if types is not None:
        sliding = types[index] == "sliding_attention"
        if types[index] not in ("full_attention", "sliding_attention"):
            raise TypeError(
                f"layer {index} has attention type {types[index]!r}, which "
                "pipetrain.hf.sequential does not build masks for"
            )
    else:
        sliding = getattr(config, "sliding_window", None) is not None and _slides(base)
    build = (masking_utils.create_sliding_window_causal_mask if sliding
             else masking_utils.create_causal_mask)
    names = set(inspect.signature(build).parameters)

    def mask(config: Any, hidden: torch.Tensor, padding: torch.Tensor,
             positions: torch.Tensor, cache: Any = None, layer: int = 0) -> Any:
        """The 4-D mask; with ``cache`` (generation), sized against block ``layer``'s entry."""
        if hidden.is_meta:  # shapes only (meta profiling): the mask's values are not there
            return None
        kwargs: dict[str, Any] = {"config": config, "attention_mask": padding,
                                  "position_ids": positions}
        kwargs["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = hidden
        kwargs["cache" if "cache" in names else "past_key_values"] = (
            None if cache is None else OneLayer(cache, layer))
        if "cache_position" in names:  # transformers before 5: positions of this call
            past = cache.get_seq_length(layer) if cache is not None else 0
            kwargs["cache_position"] = torch.arange(past, past + hidden.shape[1],
                                                    device=hidden.device)
        return build(**kwargs)

    return ("sliding" if sliding else "causal"), mask

