"""The generated interfaces and the installed package, as a workspace user gets them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from builtin_interfaces.msg import Time
from inf_mllm_interfaces.action import Ask
from inf_mllm_interfaces.msg import CacheStats, Description, Evidence
from inf_mllm_interfaces.srv import Query, Recall
from rclpy import serialization
from std_msgs.msg import Header

SOURCE_PACKAGE = Path(__file__).resolve().parents[1] / "inf_mllm_ros"

QUERY_REQUEST = {"question": "string", "max_new_tokens": "uint32", "keep_in_memory": "boolean"}
QUERY_RESPONSE = {
    "success": "boolean",
    "message": "string",
    "answer": "string",
    "newest_frame_stamp": "builtin_interfaces/Time",
    "tokens_seen": "uint64",
    "cache_fill": "uint32",
    "latency": "float",
    "retrieved_tokens": "uint32",
    "evidence": "sequence<inf_mllm_interfaces/Evidence>",
    "time_note": "string",
}
EVIDENCE = {
    "stamp": "builtin_interfaces/Time",
    "has_stamp": "boolean",
    "kind": "string",
    "camera": "string",
    "source": "string",
    "has_pose": "boolean",
    "pose": "geometry_msgs/Pose",
    "frame_id": "string",
    "text": "string",
    "weight": "float",
}
RECALL_REQUEST = {"text": "string", "max_results": "uint32", "since": "builtin_interfaces/Time",
                  "until": "builtin_interfaces/Time", "x": "double", "y": "double", "radius": "double",
                  "camera": "string"}
RECALL_RESPONSE = {"success": "boolean", "message": "string",
                   "moments": "sequence<inf_mllm_interfaces/Evidence>", "latency": "float"}
DESCRIPTION = {
    "header": "std_msgs/Header",
    "text": "string",
    "frames_seen": "uint64",
    "cache_fill": "uint32",
    "generation_time": "float",
}
CACHE_STATS = {
    "header": "std_msgs/Header",
    "capacity": "uint32",
    "fill": "uint32",
    "tokens_seen": "uint64",
    "tokens_evicted": "uint64",
    "frames_ingested": "uint64",
    "frames_dropped": "uint64",
    "texts_ingested": "uint64",
    "pinned_held": "uint32",
    "inputs_rejected": "uint64",
    "queries_answered": "uint64",
    "queries_failed": "uint64",
    "texts_waiting": "uint32",
    "queries_waiting": "uint32",
    "frame_waiting": "boolean",
    "kv_bytes": "uint64",
    "archive_tokens": "uint64",
    "archive_blocks": "uint32",
    "archive_bytes": "uint64",
    "eviction_policy": "string",
    "attention_bias": "float",
    "model_ready": "boolean",
}


ASK_GOAL = dict(QUERY_REQUEST)
ASK_RESULT = dict(QUERY_RESPONSE)  # the action's result has the fields of the service's response
ASK_FEEDBACK = {"partial_answer": "string", "tokens_generated": "uint32"}


@pytest.mark.parametrize(
    "cls, fields",
    [
        (Query.Request, QUERY_REQUEST),
        (Query.Response, QUERY_RESPONSE),
        (Description, DESCRIPTION),
        (CacheStats, CACHE_STATS),
        (Ask.Goal, ASK_GOAL),
        (Ask.Result, ASK_RESULT),
        (Ask.Feedback, ASK_FEEDBACK),
        (Evidence, EVIDENCE),
        (Recall.Request, RECALL_REQUEST),
        (Recall.Response, RECALL_RESPONSE),
    ],
    ids=["Query.Request", "Query.Response", "Description", "CacheStats", "Ask.Goal", "Ask.Result", "Ask.Feedback",
         "Evidence", "Recall.Request", "Recall.Response"],
)
def test_fields_and_types(cls, fields):
    # get_fields_and_field_types keeps declaration order: the wire format depends on it.
    assert cls.get_fields_and_field_types() == fields
    assert list(cls.get_fields_and_field_types()) == list(fields)
    cls()  # defaults construct


def test_defaults_and_type_checks():
    req = Query.Request()
    assert (req.question, req.max_new_tokens, req.keep_in_memory) == ("", 0, False)
    res = Query.Response()
    assert res.success is False and res.message == "" and isinstance(res.newest_frame_stamp, Time)
    # Since Jazzy, field checks are opt-in (check_fields or ROS_PYTHON_CHECK_FIELDS=1);
    # before, they are always on and the keyword itself does not exist.
    strict = {"check_fields": True} if "_check_fields" in CacheStats.__slots__ else {}
    with pytest.raises(AssertionError):
        Query.Request(max_new_tokens=-1, **strict)  # unsigned
    with pytest.raises(AssertionError):
        CacheStats(capacity=2**32, **strict)  # uint32
    with pytest.raises(AssertionError):
        CacheStats(no_such_field=1, **strict)


def roundtrip(msg):
    data = serialization.serialize_message(msg)
    assert isinstance(data, bytes) and data
    return serialization.deserialize_message(data, type(msg))


def test_query_roundtrip():
    req = Query.Request(question="What is on the table? ünïcode", max_new_tokens=64, keep_in_memory=True)
    assert roundtrip(req) == req
    res = Query.Response(
        success=True,
        answer="A red cup.",
        newest_frame_stamp=Time(sec=1_700_000_000, nanosec=123),
        tokens_seen=2**40,
        cache_fill=4096,
        latency=0.25,
    )
    back = roundtrip(res)
    assert back == res
    assert back.newest_frame_stamp.sec == 1_700_000_000 and back.tokens_seen == 2**40


def test_cache_stats_and_description_roundtrip():
    stats = CacheStats(
        header=Header(frame_id="camera", stamp=Time(sec=5, nanosec=6)),
        capacity=2048,
        fill=2047,
        tokens_seen=10**12,
        tokens_evicted=10**12 - 2047,
        frames_ingested=3600,
        frames_dropped=27000,
        texts_ingested=12,
        pinned_held=40,
        inputs_rejected=1,
        queries_answered=300,
        queries_failed=2,
        kv_bytes=2048 * 30 * 2 * 3 * 64 * 2,
        archive_tokens=32768,
        archive_blocks=1100,
        archive_bytes=32768 * (24 * 2 * 128 * 4 + 16),
        eviction_policy="inf_mllm",
        attention_bias=2.0**-10,  # exact in float32
        model_ready=True,
    )
    back = roundtrip(stats)
    assert back == stats
    assert back.header.frame_id == "camera" and back.eviction_policy == "inf_mllm"
    assert back.attention_bias == 2.0**-10
    desc = Description(header=Header(frame_id="camera"), text="a hallway", frames_seen=9, cache_fill=7,
                       generation_time=1.5)
    assert roundtrip(desc) == desc


def test_installed_package_is_imported():
    """Tests must exercise the package as installed by colcon, not the source tree."""
    import inf_mllm_ros

    path = Path(inf_mllm_ros.__file__)
    print("inf_mllm_ros imported from", path)
    assert path.parent != SOURCE_PACKAGE, f"source tree shadows the installed package: {path}"


def test_installed_executables():
    from ament_index_python.packages import get_package_prefix, get_package_share_directory

    lib = Path(get_package_prefix("inf_mllm_ros")) / "lib" / "inf_mllm_ros"
    for name in ("inf_mllm_node", "inf_mllm_replay", "inf_mllm_offline", "inf_mllm_demo"):
        exe = lib / name
        assert exe.is_file(), f"missing {exe}"
        assert os.access(exe, os.X_OK), f"not executable: {exe}"
    share = Path(get_package_share_directory("inf_mllm_ros"))
    assert (share / "package.xml").is_file()
    assert Path(get_package_share_directory("inf_mllm_interfaces"), "srv", "Query.srv").is_file()
    bringup = Path(get_package_share_directory("inf_mllm_bringup"))
    assert (bringup / "launch" / "inf_mllm.launch.py").is_file()
    for config in ("cpu", "demo", "desktop_gpu", "jetson_orin"):
        assert (bringup / "config" / f"{config}.yaml").is_file(), config
