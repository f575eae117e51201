"""pipetrain.LayerTree: layers named by their real paths in one module tree."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.layer_tree import Branch, LayerTree, layer_tree


def dotted() -> LayerTree:
    torch.manual_seed(0)
    return LayerTree([("encoder.embed", nn.Linear(3, 4)), ("encoder.blocks.0", nn.Linear(4, 4)),
                      ("encoder.blocks.1", nn.Linear(4, 4)), ("head", nn.Linear(4, 2))])


def test_names_are_paths_that_torch_resolves() -> None:
    tree = dotted()
    assert list(tree.state_dict()) == [
        "encoder.embed.weight", "encoder.embed.bias", "encoder.blocks.0.weight",
        "encoder.blocks.0.bias", "encoder.blocks.1.weight", "encoder.blocks.1.bias",
        "head.weight", "head.bias"]
    assert tree.get_submodule("encoder.blocks.1") is tree[2]
    assert tree.get_parameter("encoder.blocks.0.weight") is tree[1].weight
    assert isinstance(tree.get_submodule("encoder.blocks"), Branch)
    x = torch.randn(5, 3)
    zeros = {name: torch.zeros_like(p) for name, p in tree.named_parameters()}
    assert torch.equal(torch.func.functional_call(tree, zeros, (x,)), torch.zeros(5, 2))
    assert torch.equal(tree(x), tree[3](tree[2](tree[1](tree[0](x)))))


def test_a_slice_is_a_tree_of_its_layers_under_the_same_names() -> None:
    tree = dotted()
    middle = tree[1:3]
    assert type(middle) is LayerTree and middle.names == ["encoder.blocks.0", "encoder.blocks.1"]
    assert middle[0] is tree[1]
    assert list(middle.state_dict()) == [k for k in tree.state_dict() if ".blocks." in k]
    middle.load_state_dict(middle.state_dict())  # strict: torch's own check, names as paths
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "head.weight"'):
        middle.load_state_dict({**middle.state_dict(), "head.weight": torch.zeros(2, 4)})


def test_a_sequential_keeps_its_keys_and_a_reused_layer_runs_at_each_position() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(3, 4), shared, nn.Tanh(), shared).eval()
    tree = layer_tree(model)
    assert tree.names == ["0", "1", "2", "3"] and not tree.training
    assert list(tree.state_dict()) == list(model.state_dict())
    assert tree[1] is tree[3] is shared
    x = torch.randn(2, 3)
    assert torch.equal(tree(x), model(x))


def test_glue_calls_the_layer_so_its_hooks_run() -> None:
    seen = []
    layer = nn.Linear(2, 2)
    layer.register_forward_hook(lambda *_: seen.append("hook"))

    def pair_in(module: nn.Module, value: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return module(value[0]) + value[1]

    tree = LayerTree([("block", layer)], {"block": pair_in})
    x, y = torch.randn(3, 2), torch.randn(3, 2)
    assert torch.equal(tree((x, y)), layer(x) + y) and seen == ["hook", "hook"]
    assert tree[:1].glue == {"block": pair_in}


@pytest.mark.parametrize(("layers", "message"), [
    ([("a", nn.ReLU()), ("a", nn.Tanh())], "two layers are named 'a'"),
    ([("a", nn.ReLU()), ("a.b", nn.Tanh())], "would lie inside layer 'a'"),
    ([("a.b", nn.ReLU()), ("a", nn.Tanh())], "would hold the layers under it"),
    ([("a..b", nn.ReLU())], "is no path"),
])
def test_names_that_are_no_tree_are_refused(layers, message) -> None:
    with pytest.raises(ValueError, match=message):
        LayerTree(layers)


def test_glue_of_no_layer_and_models_of_another_kind_are_refused() -> None:
    with pytest.raises(ValueError, match=r"glue given for \['b'\]"):
        LayerTree([("a", nn.ReLU())], {"b": lambda layer, value: value})
    with pytest.raises(TypeError, match="Pipeline takes an nn.Sequential .*got Linear"):
        layer_tree(nn.Linear(2, 2))
