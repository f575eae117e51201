"""A user can look every option up: help(pipetrain.Pipeline) lists each parameter of Pipeline
and of its step, evaluation and checkpoint methods under "Args:", no more and no fewer."""

from __future__ import annotations

import inspect
import pydoc
import re

import pytest

import pipetrain


def documented(doc: str) -> list[str]:
    """The names an "Args:" section of ``doc`` explains, in order."""
    lines = inspect.cleandoc(doc).splitlines()
    start = lines.index("Args:") + 1
    names = []
    for line in lines[start:]:
        if line and not line.startswith(" "):
            break  # the next section
        found = re.match(r"^    (\w+): \S", line)
        if found:
            names.append(found.group(1))
    return names


def parameters(function) -> list[str]:
    return [n for n in inspect.signature(function).parameters if n != "self"]


def test_every_pipeline_parameter_is_in_the_args_list_in_order():
    assert documented(pipetrain.Pipeline.__doc__) == parameters(pipetrain.Pipeline.__init__)


@pytest.mark.parametrize("method", ["train_step", "eval_step", "save", "load"])
def test_every_method_parameter_is_in_its_args_list(method):
    function = getattr(pipetrain.Pipeline, method)
    assert documented(function.__doc__) == parameters(function)
    assert "Returns:" in function.__doc__


def test_help_shows_each_option():
    text = pydoc.render_doc(pipetrain.Pipeline, renderer=pydoc.plaintext)
    for name in parameters(pipetrain.Pipeline.__init__):
        assert re.search(rf"^\s*\|?\s+{name}: ", text, re.MULTILINE), name
    assert "takes no arguments" in pipetrain.Pipeline.flush.__doc__

