"""`serving.models`: a fitted profile becomes the cluster's cost models only if it timed this cluster's engines.

A profile of another model, dtype, block size or prefill group (the fields examples/profile_engine.py records)
became the cluster's cost model silently, and a group's fit was used as it is where the unprofiled path prices a
chunked pipeline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from serving.config import ClusterConfig, load_config
from serving.machine import Machine
from serving.models import cost_models, read_profile

from mooncake.errors import ConfigError
from mooncake.sched.cost import FittedPrefillModel
from mooncake.sched.step import FittedStepModel

TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.toml"
PREFILL = FittedPrefillModel(coefficients=(0.004, 1e-5, 1e-9))
DECODE = FittedStepModel(coefficients=(0.002, 1e-4, 1e-7))


def tiny(profile: Path, **sections: dict[str, Any]) -> ClusterConfig:
    config = load_config(TINY, machine=Machine())
    for section, values in sections.items():
        config = config.with_overrides(section, **values)
    return config.with_overrides("prefill", profile=str(profile))


def write_profile(tmp_path: Path, **measured: Any) -> Path:
    """A profile as profile_engine.py writes it (the tiny cluster's, unless `measured` says otherwise; a value of
    None leaves the field out)."""
    fields = {
        "model": "tiny@seed=0/float32",
        "dtype": "float32",
        "block_tokens": 16,
        "chunk_tokens": 512,
        "pipeline_size": 1,
    }
    fields.update(measured)
    data = {key: value for key, value in fields.items() if value is not None}
    data |= {"prefill": json.loads(PREFILL.to_json()), "decode": json.loads(DECODE.to_json())}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return path


def test_a_profile_of_this_clusters_engines_is_its_cost_model(tmp_path: Path) -> None:
    """The tiny cluster's own profile (its namespace, as `--config` writes it) is taken as it is."""
    prefill, step = cost_models(tiny(write_profile(tmp_path)))
    assert prefill == PREFILL and step == DECODE


@pytest.mark.parametrize(
    ("measured", "cluster"),
    [
        ({"model": "small@seed=0/float32"}, "this cluster: 'tiny@seed=0/float32', [model] preset = 'tiny'"),
        ({"model": "small"}, "this cluster: 'tiny@seed=0/float32', [model] preset = 'tiny'"),
        ({"model": "tiny@seed=3/float32"}, "[model] preset = 'tiny'"),
        ({"dtype": "bfloat16"}, "this cluster: [model] dtype = 'float32'"),
        ({"block_tokens": 32}, "this cluster: [model] block_tokens = 16"),
        ({"block_tokens": 16.0}, "this cluster: [model] block_tokens = 16"),
        ({"pipeline_size": 2}, "this cluster: [prefill] pipeline_size = 1"),
        # a prefill chunked otherwise takes another time (profile_engine.py without --config chunked by 4096)
        ({"chunk_tokens": 4096}, "this cluster: [prefill] chunk_tokens = 512"),
    ],
)
def test_a_profile_of_other_engines_is_refused_naming_the_field_and_both_values(
    tmp_path: Path, measured: dict[str, Any], cluster: str
) -> None:
    """Each field profile_engine.py records, where it differs: a ConfigError naming `[prefill] profile`, the
    file, the field with the profile's value and the cluster's."""
    path = write_profile(tmp_path, **measured)
    with pytest.raises(ConfigError) as raised:
        cost_models(tiny(path))
    message = str(raised.value)
    (field, value), *_ = measured.items()
    assert f"[prefill] profile = {str(path)!r}" in message
    assert f"{field} = {value!r}" in message and cluster in message


def test_every_field_that_differs_is_named(tmp_path: Path) -> None:
    """A profile of the `small` model in bfloat16 with 32-token blocks, for a two-process group: all four."""
    path = write_profile(tmp_path, model="small", dtype="bfloat16", block_tokens=32, pipeline_size=2)
    with pytest.raises(ConfigError) as raised:
        cost_models(tiny(path))
    for field in ("model = 'small'", "dtype = 'bfloat16'", "block_tokens = 32", "pipeline_size = 2"):
        assert field in str(raised.value)


def test_a_model_profile_names_the_preset_and_fits_any_seed(tmp_path: Path) -> None:
    """`profile_engine.py --model tiny` writes the preset's bare name (its seed-0 weights): the tiny cluster takes
    it, whatever its seed (the weights' values do not change the time), as docs/cluster.md's example does."""
    path = write_profile(tmp_path, model="tiny")
    assert cost_models(tiny(path))[0] == PREFILL
    assert cost_models(tiny(path, model={"seed": 7}))[1] == DECODE


def test_a_profile_without_the_measured_fields_is_taken_on_trust_but_one_process(tmp_path: Path) -> None:
    """A fit written by hand (no model, dtype or block size) is taken for those; without "pipeline_size" (as
    before chunked pipelines) it timed one process, so a cluster of two-process prefill groups refuses it."""
    path = write_profile(tmp_path, model=None, dtype=None, block_tokens=None, chunk_tokens=None, pipeline_size=None)
    assert cost_models(tiny(path)) == (PREFILL, DECODE)
    with pytest.raises(ConfigError, match=r"pipeline_size = 1 \(this cluster: \[prefill\] pipeline_size = 2\)"):
        cost_models(tiny(path, prefill={"pipeline_size": 2}))
    grouped = write_profile(tmp_path, pipeline_size=2)
    assert cost_models(tiny(grouped, prefill={"pipeline_size": 2})) == (PREFILL, DECODE)


def test_read_profile_checks_the_engines_only_given_a_config(tmp_path: Path) -> None:
    """Without a config (a file's own check) the mismatch is not read_profile's to find."""
    config = tiny(write_profile(tmp_path))
    other = tmp_path / "other"
    other.mkdir()
    path = write_profile(other, block_tokens=64)
    assert read_profile(str(path)) == (PREFILL, DECODE)
    with pytest.raises(ConfigError, match="block_tokens = 64"):
        read_profile(str(path), config=config)


@pytest.mark.parametrize(
    ("section", "coefficients", "named"),
    [
        ("decode", [0.02, -0.001, 0.0], "coefficient c1 must be a finite number >= 0, got -0.001"),
        ("prefill", [1e-3, 1e-5, -1e-9], "coefficient c2 must be a finite number >= 0, got -1e-09"),
        ("decode", [0.0, 0.0, 1e-7], "c0 + c1 must be > 0"),
    ],
)
def test_a_hand_edited_profile_that_its_fit_would_refuse_is_refused(
    tmp_path: Path, section: str, coefficients: list[float], named: str
) -> None:
    """A bigger batch timed faster, a longer prompt faster, a step of one request in no time: accepted from a
    profile, though the fits refuse them (tests/sched for the models' own check)."""
    path = write_profile(tmp_path)
    data = json.loads(path.read_text())
    data[section]["coefficients"] = coefficients
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=f"\\[prefill\\] profile = .*{named.replace('+', '[+]')}"):
        read_profile(str(path))


def test_loading_a_config_refuses_a_profile_of_other_engines(tmp_path: Path) -> None:
    """The config's own check of `[prefill] profile` (at load, and when overridden) asks the same question as
    the cost models, naming the config file: a profile of another dtype is refused before any engine starts."""
    path = write_profile(tmp_path, dtype="bfloat16")
    config = tmp_path / "cluster.toml"
    config.write_text(TINY.read_text().replace('profile = ""', f"profile = {json.dumps(str(path))}", 1))
    with pytest.raises(ConfigError, match=r"cluster\.toml.*dtype = 'bfloat16' \(this cluster: \[model\] dtype"):
        load_config(config, machine=Machine())
