"""Profiles survive JSON, and broken files say what is wrong."""

from __future__ import annotations

import json

import pytest

from partitioner import Boundary, LayerCost, Profile, ProfileError, load_pipedream


def _profile() -> Profile:
    layers = [
        LayerCost("embed", 0.001, 0.002, 4096, 100, 400, 800),
        LayerCost("block", 0.003, 0.006, 4096, 200, 800, 1600),
        LayerCost("head", 0.0005, 0.001, 64, 10, 40),
    ]
    return Profile(device="cpu", batch_size=4, layers=layers, input_bytes=128)


def test_round_trip_through_a_file(tmp_path) -> None:
    profile = _profile()
    path = tmp_path / "profile.json"
    profile.save(path)
    assert Profile.load(path) == profile
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["format"] == "pipetrain-profile"
    assert data["layers"][1]["forward"] == 0.003


def test_round_trip_keeps_branch_crossings() -> None:
    profile = load_pipedream("resnet18")
    again = Profile.from_json(profile.to_json())
    assert again == profile
    assert again.boundaries is not None and again.boundaries[5] == profile.boundaries[5]


def test_unknown_version_is_refused_with_the_fix() -> None:
    data = json.loads(_profile().to_json())
    data["version"] = 2
    with pytest.raises(ProfileError, match=r"version 2 is not supported.*pipetrain profile"):
        Profile.from_json(json.dumps(data))


@pytest.mark.parametrize("key", ["device", "batch_size", "layers", "version"])
def test_missing_top_level_field_is_named(key: str) -> None:
    data = json.loads(_profile().to_json())
    del data[key]
    with pytest.raises(ProfileError, match=f"missing the field '{key}'"):
        Profile.from_json(json.dumps(data))


def test_missing_layer_field_names_the_layer() -> None:
    data = json.loads(_profile().to_json())
    del data["layers"][2]["backward"]
    with pytest.raises(ProfileError, match="layer 2 is missing the field 'backward'"):
        Profile.from_json(json.dumps(data))


def test_wrong_types_and_values_are_refused(tmp_path) -> None:
    data = json.loads(_profile().to_json())
    data["layers"][0]["param_count"] = "many"
    with pytest.raises(ProfileError, match="param_count"):
        Profile.from_json(json.dumps(data))
    data = json.loads(_profile().to_json())
    data["layers"][0]["forward"] = -1.0
    with pytest.raises(ProfileError, match="forward time must be >= 0"):
        Profile.from_json(json.dumps(data))
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="bad.json: profile is not valid JSON"):
        Profile.load(path)


def test_boundaries_must_fit_the_layers() -> None:
    layers = _profile().layers
    with pytest.raises(ValueError, match="3 layers have 2 boundaries"):
        Profile("cpu", 1, layers, boundaries=[Boundary((0,))])
    with pytest.raises(ValueError, match="not before it"):
        Profile("cpu", 1, layers, boundaries=[Boundary((1,)), Boundary((1,))])
