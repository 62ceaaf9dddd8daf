"""The settings table is the one source: the parameter table in docs/node.md matches it, and the node's
parameters file builds the same engine in the node and in the offline runner."""

from __future__ import annotations

import argparse
import re

import pytest
import yaml

from inf_mllm_ros.bags.offline import UsageError, build_parser, checked_config, resolve_settings
from inf_mllm_ros.settings import BY_NAME, DEFAULTS, PARAMETERS, value_problem
from inf_mllm_ros.settings import stream_config as node_stream_config

from conftest import REPO_ROOT

ROS_TYPES = {bool: "bool", int: "int", float: "double", str: "string", list: "string[]"}


def readme_parameter_rows() -> list[list[str]]:
    text = (REPO_ROOT / "docs" / "node.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Parameters\n"):]
    section = section[: section.index("\n## ", 5)]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_the_readme_parameter_table_is_the_settings_table():
    rows = readme_parameter_rows()
    assert [r[0].strip("`") for r in rows] == [p.name for p in PARAMETERS]
    for row, p in zip(rows, PARAMETERS):
        name, kind, default, allowed, run_time = row[:5]
        assert kind == ROS_TYPES[p.type], p.name
        assert run_time == ("no" if p.read_only else "yes"), p.name
        if default.startswith("*"):  # a long text, shown shortened
            assert p.default.startswith(default.strip("*").rstrip(". ").rstrip(".")), p.name
        else:
            shown = default.strip("`")
            expected = {True: "true", False: "false"}.get(p.default, p.default) if p.type is bool else p.default
            assert shown == ('""' if expected == "" else str(expected)), p.name
        if p.low is not None:
            numbers = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", allowed)]
            assert numbers[0] == p.low and numbers[-1] == p.high, (p.name, allowed)
            assert ("odd" in allowed) == (p.step == 2), p.name
        else:
            assert allowed == "", p.name


def offline_settings(tmp_path, params: dict, *cli: str) -> dict:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"/**": {"ros__parameters": params}}))
    args = build_parser().parse_args(["bag", "--params", str(path), *cli])
    return resolve_settings(args)


def test_one_parameters_file_builds_one_engine(tmp_path):
    params = {"cache_size": 300, "eviction_policy": "h2o", "recent_size": 0, "score_memory": False, "score_pool": 5,
              "chunk_size": 32, "attention_bias": 2, "system_prompt": "Remember.", "max_new_tokens": 9}
    offline_config = checked_config(offline_settings(tmp_path, params))
    # What the node builds: its declared parameters, the file over the defaults.
    node_config = node_stream_config(dict(DEFAULTS, **params))
    assert offline_config == node_config
    # The policy takes its own settings only: h2o has a recent window and no bias, score memory or pooling.
    assert node_config.capacity == 300 and node_config.policy_settings == {"recent_size": 0}


@pytest.mark.parametrize("params, reason", [
    ({"position_mode": "original"}, "not a parameter of inf_mllm_node"),  # an engine field the node does not declare
    ({"cache_size": "big"}, "cache_size must be of type int"),
    ({"score_pool": 4}, "score_pool must be 1 plus a multiple of 2"),
    ({"stats_period": 1e-9}, "stats_period must be 0 (off) or at least 0.05 s"),
    ({"attention_bias": 500.0}, "attention_bias must be in [0, 100]"),
    ({"eviction_policy": "lru"}, "eviction_policy must be one of"),
])
def test_what_the_node_would_not_take_the_offline_runner_refuses(tmp_path, params, reason):
    with pytest.raises(UsageError) as refused:
        offline_settings(tmp_path, params)
    assert reason in str(refused.value)


def test_the_command_line_is_checked_like_the_file(tmp_path):
    with pytest.raises(UsageError, match="score_pool"):
        offline_settings(tmp_path, {}, "--score-pool", "6")
    assert offline_settings(tmp_path, {"cache_size": 300}, "--cache-size", "400")["cache_size"] == 400
    # A switch of a policy is a flag pair, over the file's value either way.
    assert offline_settings(tmp_path, {"score_memory": True}, "--no-score-memory")["score_memory"] is False
    assert offline_settings(tmp_path, {"score_memory": False}, "--score-memory")["score_memory"] is True
    assert offline_settings(tmp_path, {"score_memory": False})["score_memory"] is False


def test_every_default_passes_its_own_checks():
    assert all(value_problem(p.name, p.default) is None for p in PARAMETERS)
    assert isinstance(build_parser(), argparse.ArgumentParser)


@pytest.mark.parametrize("name, text, expected", [("cache_size", "2048", 2048), ("attention_bias", "2", 2.0),
                                                  ("autostart", "False", False), ("score_memory", "false", False),
                                                  ("model", " a b ", " a b ")])
def test_launch_arguments_become_typed_parameter_values(name, text, expected):
    value = BY_NAME[name].rule.from_text(text)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("name, text, reason", [
    ("cache_size", "abc", "cache_size:='abc' is not a valid int"),
    ("score_pool", "4", "score_pool must be 1 plus a multiple of 2"),
    ("autostart", "yes", "autostart:='yes' is not a valid bool"),
    ("frame_rate", "500", "frame_rate must be in [0, 120]"),
])
def test_a_bad_launch_argument_names_itself(name, text, reason):
    with pytest.raises(ValueError) as refused:
        BY_NAME[name].rule.from_text(text)
    assert reason in str(refused.value)


def test_the_launch_reads_every_rule_as_the_node_checks_it():
    # The launch file imports the table itself (test_layout.py: without torch) and checks its arguments with each
    # parameter's own rule, as the node does.
    rules = {p.name: p.rule for p in PARAMETERS}
    with pytest.raises(ValueError, match="eviction_policy must be one of"):
        rules["eviction_policy"].from_text("lru")
    with pytest.raises(ValueError, match="stats_period must be 0 \\(off\\) or at least"):
        rules["stats_period"].from_text("0.001")
    assert rules["eviction_policy"].from_text("h2o") == "h2o" and rules["stats_period"].from_text("0") == 0.0


@pytest.mark.parametrize("name", ["cpu", "demo", "desktop_gpu", "jetson_orin"])
def test_every_shipped_parameters_file_is_valid_and_builds_an_engine(name):
    # The bringup package's files are what users start from: each value must pass the node's own rules, and the
    # file must make a stream configuration the engine accepts.
    path = REPO_ROOT / "inf_mllm_bringup" / "config" / f"{name}.yaml"
    params = yaml.safe_load(path.read_text(encoding="utf-8"))["/**"]["ros__parameters"]
    params.pop("use_sim_time", None)  # every ROS node's own parameter
    assert params, path
    problems = {key: value_problem(key, value) for key, value in params.items()}
    assert not any(problems.values()), problems
    node_stream_config(dict(DEFAULTS, **params))


def test_the_three_robots_file_gives_each_robot_valid_values_of_its_own_and_the_models_to_all():
    """config/three_robots.yaml (`streams`, node/streams.py): each robot's values are the file's top ones and its own,
    all of them pass the node's rules, none of its own is the model's, and each robot's memory builds."""
    from inf_mllm_ros.node.streams import stream_names
    from inf_mllm_ros.settings import MODEL_PARAMETERS

    path = REPO_ROOT / "inf_mllm_bringup" / "config" / "three_robots.yaml"
    params = yaml.safe_load(path.read_text(encoding="utf-8"))["/**"]["ros__parameters"]
    robots = stream_names(params["streams"])
    assert len(robots) == 3
    shared = {k: v for k, v in params.items() if k not in robots}
    configs = []
    for robot in robots:
        own = params[robot]
        assert not set(own) & set(MODEL_PARAMETERS), own
        values = dict(shared, **own)
        problems = {key: value_problem(key, value) for key, value in values.items()}
        assert not any(problems.values()), (robot, problems)
        configs.append(node_stream_config(dict(DEFAULTS, **values)))
    assert len({c.capacity for c in configs}) > 1  # a robot's own value is its own


def test_every_live_stream_setting_changed_reaches_the_stream():
    """A node parameter changed while the node runs goes through one snapshot (`LiveSettings.changed`) to the stream
    (`stream_config`): each live setting that shapes the stream must arrive with its new value, the others kept."""
    import dataclasses

    from inf_mllm_ros.engine.runtime.live_settings import LiveSettings
    from inf_mllm_ros.engine.stream_config import RECONFIGURABLE, StreamConfig

    config = StreamConfig()
    live = LiveSettings.of(config)
    shared = {f.name for f in dataclasses.fields(LiveSettings)} & {f.name for f in dataclasses.fields(StreamConfig)}
    shared -= {"policy_settings"}  # the knobs: merged, not replaced (test_engine.py)
    assert {"answer_prompt", "when_prompt", "system_prompt", "max_new_tokens", "max_text_chars"} <= shared <= RECONFIGURABLE
    for name in sorted(shared):
        new = "a new prompt" if isinstance(getattr(config, name), str) else 7
        reached = live.changed(config, **{name: new}).stream_config(config)
        assert getattr(reached, name) == new, name
        assert {n: getattr(reached, n) for n in shared - {name}} == {n: getattr(config, n) for n in shared - {name}}
