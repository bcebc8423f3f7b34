"""Typed configuration: unknown keys and wrong values are errors that say what to fix."""

from __future__ import annotations

import pytest

from jfcore.config import ConfigError, apply_overrides, from_dict, load_file, load_sections, replace_checked
from jfcore.decoding import DecodeConfig


def test_builds_and_coerces():
    config = from_dict(DecodeConfig, {"method": "multiblock", "block_size": 32, "spawn_ratio": 1})
    assert config.block_size == 32 and config.spawn_ratio == 1.0 and config.num_blocks == 2


@pytest.mark.parametrize(
    "data,message",
    [
        ({"blocksize": 8}, "unknown key 'blocksize' (did you mean 'block_size'?)"),
        ({"method": "beam"}, "DecodeConfig.method: 'beam' is not one of"),
        ({"block_size": "8"}, "DecodeConfig.block_size: expected an integer"),
        ({"block_size": True}, "expected an integer"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"spawn_ratio": 1.5}, "spawn_ratio must be in (0, 1]"),
        ({"record_trajectories": True, "method": "multiblock"}, "record_trajectories needs method 'jacobi'"),
        ({"record_trajectories": True, "rolling": True}, "without prompt lookup or rolling"),
        ({"rolling": True, "method": "multiblock"}, "rolling needs method 'jacobi' and block_size >= 2"),
        ({"rolling": True, "block_size": 1}, "rolling needs method 'jacobi' and block_size >= 2"),
    ],
)
def test_rejects_bad_input(data, message):
    with pytest.raises(ConfigError) as err:
        from_dict(DecodeConfig, data)
    assert message in str(err.value)


def test_files_and_replace(tmp_path):
    path = tmp_path / "decode.yaml"
    path.write_text("method: jacobi\nblock_size: 64\n")
    config = from_dict(DecodeConfig, load_file(path))
    assert replace_checked(config, block_size=8).block_size == 8
    with pytest.raises(ConfigError, match="unknown key 'nope'"):
        replace_checked(config, nope=1)
    with pytest.raises(ConfigError, match="config file not found"):
        load_file(tmp_path / "missing.yaml")


def test_overrides_apply_in_order_as_yaml_values_and_are_checked_like_the_file(tmp_path):
    base = {"training": {"epochs": 2, "model": {"name_or_path": "m"}}, "launch": {"processes": 2}}
    done = apply_overrides(
        base, ["training.epochs=5", "training.model.dtype=bfloat16", "launch.processes=1", "x.y=[1, 2]"]
    )
    assert done == {
        "training": {"epochs": 5, "model": {"name_or_path": "m", "dtype": "bfloat16"}},
        "launch": {"processes": 1},
        "x": {"y": [1, 2]},
    }
    assert base["training"]["epochs"] == 2  # the loaded file's data is not changed
    with pytest.raises(ConfigError, match="write key=value"):
        apply_overrides(base, ["training.epochs"])
    with pytest.raises(ConfigError, match="epochs is a value, not a section"):
        apply_overrides(base, ["training.epochs.max=3"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("decode: {block_size: 8}\n")
    loaded = load_sections(recipe, {"decode": DecodeConfig}, overrides=["decode.block_size=32", "decode.method=ar"])
    assert loaded["decode"].block_size == 32 and loaded["decode"].method == "ar"
    with pytest.raises(ConfigError, match="did you mean 'block_size'"):
        load_sections(recipe, {"decode": DecodeConfig}, overrides=["decode.blocksize=32"])
