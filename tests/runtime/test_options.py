"""Each Pipeline option is declared once, in pipetrain/runtime/options.py: Pipeline's signature,
its typed keywords (PipelineOptions), the Args section of its docstring and the fields of the
resolved PipelineConfig must say what that table says, so an option added, renamed or
re-defaulted in one place and not the others fails here."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.runtime.config import PipelineConfig
from pipetrain.runtime.options import OPTIONS, RENAMED, PipelineOptions, checked
from schedules.registry import RECOMPUTE_MODES, recompute_below

DERIVED = ["autocast_dtype", "loss_scaling", "planned_ranks", "planned_microbatch",
           "planned_replicas", "lists"]


def mlp() -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(3, 3) for _ in range(4)))


def args_entries(doc: str) -> dict[str, str]:
    """The text of each entry of ``doc``'s "Args:" section, whitespace collapsed."""
    lines = inspect.cleandoc(doc).splitlines()
    entries: dict[str, str] = {}
    name = None
    for line in lines[lines.index("Args:") + 1:]:
        if line and not line.startswith(" "):
            break
        found = re.match(r"^    (\w+): (.*)", line)
        if found:
            name = found.group(1)
            entries[name] = found.group(2)
        elif name is not None:
            entries[name] += " " + line.strip()
    return entries


@pytest.mark.parametrize("shown", ["__init__", "class"])
def test_the_signature_is_the_table(shown):
    """What help() and IDEs show, for the class and its __init__: the same names in the same
    order, each keyword-only, with the table's default and type."""
    target = pipetrain.Pipeline.__init__ if shown == "__init__" else pipetrain.Pipeline
    parameters = list(inspect.signature(target).parameters.values())
    head = ["self", "model", "balance"] if shown == "__init__" else ["model", "balance"]
    assert [p.name for p in parameters[: len(head)]] == head
    options = parameters[len(head):]
    assert [p.name for p in options] == [o.name for o in OPTIONS]
    for parameter, option in zip(options, OPTIONS, strict=True):
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, option.name
        assert parameter.default == option.default, option.name
        assert type(parameter.default) is type(option.default), option.name
        assert parameter.annotation == option.type, option.name  # a string: postponed


def test_the_constructor_takes_the_options_as_typed_keywords():
    """``__init__(self, model, balance=None, **options: Unpack[PipelineOptions])`` (PEP 692):
    PipelineOptions, what a type checker holds a call to, has the table's names in its order,
    each optional, with the type the table gives."""
    code = pipetrain.Pipeline.__init__.__code__
    assert code.co_varnames[: code.co_argcount] == ("self", "model", "balance")
    assert code.co_kwonlyargcount == 0 and code.co_flags & inspect.CO_VARKEYWORDS
    annotations = PipelineOptions.__annotations__
    assert list(annotations) == [*(o.name for o in OPTIONS), *RENAMED]  # old names last
    assert PipelineOptions.__optional_keys__ == frozenset(annotations)
    for option in OPTIONS:  # postponed: a string, or typing's reference to one
        written = annotations[option.name]
        assert getattr(written, "__forward_arg__", written) == option.type, option.name
    for old, new in RENAMED.items():
        assert annotations[old] == annotations[new], old


def test_each_group_is_one_run_of_options():
    """Options a user thinks of together (precision and clipping, the checkpoint folder and
    its period, the asynchronous schedules' weight options) sit side by side in the
    signature and in help()."""
    groups = [o.group for o in OPTIONS]
    runs = [g for i, g in enumerate(groups) if i == 0 or groups[i - 1] != g]
    assert len(runs) == len(set(runs)), runs
    said = re.search(r"come in groups:\s+([^.]*)\.", pipetrain.Pipeline.__doc__)
    assert said is not None and re.split(r",\s+", said.group(1)) == runs
    by_name = {o.name: o.group for o in OPTIONS}
    for together in (("precision", "clip_grad_norm", "nonfinite"),
                     ("checkpoint_dir", "checkpoint_every"),
                     ("weight_stashing", "weight_prediction", "delay_compensation")):
        assert len({by_name[name] for name in together}) == 1, together


def test_the_args_section_is_the_tables_order_and_doc():
    entries = args_entries(pipetrain.Pipeline.__doc__)
    assert list(entries) == ["model", "balance", *(o.name for o in OPTIONS)]
    for option in OPTIONS:
        assert entries[option.name].startswith(option.doc), (option.name, option.doc)
        assert "\n" not in option.doc and len(option.doc) <= 120, option.name


def test_the_config_holds_the_tables_options_as_checked():
    """Its fields are the balance, the options the config takes (a plan is merged in, not
    kept), in the table's order, then what it derives; built from no options, each holds its
    default as that option's check returns it."""
    taken = [o.name for o in OPTIONS if o.part == "config" and o.name != "plan"]
    fields = [f.name for f in dataclasses.fields(PipelineConfig)]
    assert fields == ["balance", *taken, *DERIVED]
    resolved = PipelineConfig.resolve(mlp(), [2, 2])
    by_default = checked("config", {})
    fallbacks = {"chunks": 1, "schedule": "1f1b", "recompute": "never"}  # see resolve
    for name in taken:
        assert getattr(resolved, name) == fallbacks.get(name, by_default[name]), name


def test_every_option_reaches_its_part():
    """A value given to Pipeline arrives in the part that takes it, not its default."""
    pipe = pipetrain.Pipeline(
        mlp(), [2, 2], devices=["cpu", "cpu"], chunks=2, schedule="gpipe", recompute="always",
        timeout=12.5, precision="bf16", clip_grad_norm=1.5, nonfinite="raise",
        checkpoint_every=7, check_batches=False, track_memory=True, init_seed=3,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    config = pipe.config
    assert (config.chunks, config.schedule, config.recompute, config.timeout) == (
        2, "gpipe", "always", 12.5
    )
    assert (config.precision, config.autocast_dtype, config.clip_grad_norm) == (
        "bf16", torch.bfloat16, 1.5
    )
    assert (config.nonfinite, config.checkpoint_every, config.check_batches) == ("raise", 7, False)
    assert config.track_memory and pipe.stages[0].ledger is not None
    assert [s.recompute_below for s in pipe.stages] == [2, 2]
    assert [str(s.device) for s in pipe.stages] == ["cpu", "cpu"]


def test_an_unknown_option_is_refused_naming_the_known_ones():
    with pytest.raises(TypeError, match=r"'chunk'.*chunks"):
        PipelineConfig.resolve(mlp(), [2, 2], chunk=4)


def test_pipeline_refuses_an_unknown_keyword_naming_it_and_the_closest_option():
    """As Python refuses an unexpected keyword argument, before anything is built."""
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'chunk' \(did you mean "
                                        r"'chunks'\?\), 'colour'; its options are plan, chunks"):
        pipetrain.Pipeline(mlp(), [2, 2], devices=["cpu", "cpu"], chunk=2, colour="red")


@pytest.mark.parametrize("checkpoint", ["sometimes", ["never", "often"]])
def test_a_recompute_mode_is_one_of_the_schedules_layers(checkpoint):
    """The modes are schedules/registry.py's RECOMPUTE_MODES, checked directly."""
    with pytest.raises(ValueError, match="recompute.* must be one of .*except_last"):
        PipelineConfig.resolve(mlp(), [2, 2], recompute=checkpoint)
    assert [recompute_below(mode, 4) for mode in RECOMPUTE_MODES] == [0, 3, 4]


def test_recomputation_under_its_old_name_checkpoint_works_with_a_warning():
    """``checkpoint=`` (recomputation, beside ``checkpoint_dir=`` and ``checkpoint_every=``,
    which save) is now ``recompute=``: the old name still works for one release, warning at
    the caller's line, as does ``pipe.checkpoint``; both names at once are refused."""
    with pytest.warns(FutureWarning, match=r"checkpoint=\.\.\.\) is now recompute=") as said:
        pipe = pipetrain.Pipeline(mlp(), [2, 2], devices=["cpu", "cpu"], checkpoint="always")
    assert [w.filename for w in said] == [__file__]
    assert pipe.config.recompute == pipe.recompute == "always"
    assert {s.recompute_below for s in pipe.stages} == {1}  # "always", one micro-batch
    with pytest.warns(FutureWarning, match="Pipeline.checkpoint is now Pipeline.recompute"):
        assert pipe.checkpoint == "always"
    with pytest.warns(FutureWarning):
        assert PipelineConfig.resolve(mlp(), [2, 2], checkpoint="always").recompute == "always"
    with pytest.raises(TypeError, match="both checkpoint= and recompute="):
        pipetrain.Pipeline(mlp(), [2, 2], devices=["cpu", "cpu"], checkpoint="always",
                           recompute="never")
