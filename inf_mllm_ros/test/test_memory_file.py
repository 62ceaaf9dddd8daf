"""The memory file: a restored memory continues exactly where the saved one was; a file that cannot be
used is refused with its reason and changes nothing; a writer killed mid-write leaves a loadable file; the
archive's log takes only what is new at each checkpoint, and damage to it costs only the blocks from there on."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from inf_mllm_ros.engine.persistence import archive_log
from inf_mllm_ros.engine.runtime import checkpoints
from inf_mllm_ros.engine.runtime.engine import StreamingEngine
from inf_mllm_ros.engine.models.loading import load_model
from inf_mllm_ros.engine.persistence.memory_file import MemoryFileError, load_memory, save_memory
from inf_mllm_ros.testing.random_models import build_model_folder
from inf_mllm_ros.engine.runtime.stream import KVStream
from inf_mllm_ros.engine.stream_config import StreamConfig
from inf_mllm_ros.engine.answering import StreamStoppedError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = [f"Note {i}: the {c} crate on shelf {i} holds {i * 7} bolts." for i, c in
         enumerate(["red", "blue", "green", "grey", "white", "black", "brown", "pink", "gold", "teal"])]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": build_model_folder("llama", root / "llama"),
        "llama_other": build_model_folder("llama", root / "llama_other", seed=1),
        "qwen2_vl": build_model_folder("qwen2_vl", root / "qwen2_vl"),
        "llama_small": build_model_folder("llama", root / "llama_small", size="small"),
    }


def config(policy: str = "inf_mllm", capacity: int = 48) -> StreamConfig:
    return StreamConfig(capacity=capacity, policy=policy, chunk_size=16, system_prompt="You remember.")


def filled(adapter, policy="inf_mllm", capacity=48, texts=TEXTS) -> KVStream:
    stream = KVStream(adapter, config(policy, capacity))
    for text in texts:
        stream.push_text(text, stamp=1.5)
    return stream


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("policy", ["inf_mllm", "h2o", "streaming_llm"])
def test_a_restored_memory_continues_exactly(folders, tmp_path, dtype, policy):
    adapter = load_model(folders["llama"], device="cpu", dtype=dtype)
    saved = filled(adapter, policy)
    assert saved.cache.evictions > 0, "the memory must have been through evictions"
    path = tmp_path / "memory.safetensors"
    info = save_memory(saved, path)
    on_disk = path.stat().st_size + sum(f.stat().st_size for f in tmp_path.glob("memory.safetensors.archive/*"))
    assert info.bytes == on_disk and not list(tmp_path.glob(".*.tmp"))
    restored = KVStream(adapter, config(policy))
    load_memory(restored, path)
    assert restored.stats() == saved.stats()
    # Whatever comes next, both memories answer alike and evict alike.
    for stream in (saved, restored):
        stream.push_text("Later: the red crate was moved.", stamp=9.0)
    assert torch.equal(saved.cache.cached_seq(1), restored.cache.cached_seq(1))
    ids = adapter.tokenize("Which crate was moved?")
    assert torch.equal(saved.push_tokens(ids, return_logits=True), restored.push_tokens(ids, return_logits=True))
    assert saved.ask("What was moved?").text == restored.ask("What was moved?").text


def test_the_archive_survives_a_restart_with_the_memory(folders, tmp_path):
    adapter = load_model(folders["qwen2_vl"], device="cpu", dtype="float32")
    saved = KVStream(adapter, config(capacity=48))
    for i, text in enumerate(TEXTS):
        saved.push_text(text, stamp=float(i))
        if i % 4 == 0:
            saved.push_frame(np.random.default_rng(i).integers(0, 256, (84, 112, 3), dtype=np.uint8), stamp=i + 0.5)
    assert saved.archive.tokens == saved.tokens_seen and saved.cache.evictions > 0
    path = tmp_path / "memory.safetensors"
    save_memory(saved, path)
    restored = KVStream(adapter, config(capacity=48))
    load_memory(restored, path)
    before, after = saved.archive.export_state(), restored.archive.export_state()
    assert before.keys() == after.keys()
    for name in before:  # exactly (a block without a stream time has a NaN stamp)
        torch.testing.assert_close(before[name], after[name], rtol=0, atol=0, equal_nan=True)
    question = "How many bolts does the red crate hold?"
    first, again = saved.ask(question, max_new_tokens=6), restored.ask(question, max_new_tokens=6)
    assert first.retrieved_tokens > 0
    assert (first.text, first.retrieved_stamps) == (again.text, again.retrieved_stamps)
    # A smaller archive takes the newest blocks that fit; a memory without one restores none.
    small = KVStream(adapter, StreamConfig(**{**config(capacity=48).__dict__, "archive_size": 100}))
    load_memory(small, path)
    assert 0 < small.archive.tokens <= 100
    assert small.archive.blocks[-1].seq_end == saved.tokens_seen
    off = KVStream(adapter, StreamConfig(**{**config(capacity=48).__dict__, "archive_size": 0}))
    load_memory(off, path)
    assert off.archive.tokens == 0 and off.stats().fill == saved.stats().fill


def test_frames_and_their_positions_survive(folders, tmp_path):
    adapter = load_model(folders["qwen2_vl"], device="cpu", dtype="float32")
    rng = np.random.default_rng(0)
    saved = KVStream(adapter, config(capacity=96))
    for t in range(4):
        saved.push_frame(rng.integers(0, 255, (56, 84, 3), dtype=np.uint8), stamp=float(t))
        saved.push_text(TEXTS[t])
    save_memory(saved, tmp_path / "m")
    restored = KVStream(adapter, config(capacity=96))
    load_memory(restored, tmp_path / "m")
    frame = rng.integers(0, 255, (56, 84, 3), dtype=np.uint8)
    assert saved.ask("What is there?").text == restored.ask("What is there?").text
    saved.push_frame(frame, 9.0)
    restored.push_frame(frame, 9.0)
    assert restored.stats() == saved.stats() and restored.newest_frame_stamp == 9.0


def test_pins_survive_a_restart(folders, tmp_path):
    adapter = load_model(folders["llama"], device="cpu", dtype="float32")
    saved = KVStream(adapter, config())
    saved.push_text("The gate code is 2231.", pin=True)
    for text in TEXTS:
        saved.push_text(text)
    held = saved.stats().pinned_held
    assert held > 0 and saved.cache.evictions > 0
    save_memory(saved, tmp_path / "m")
    restored = KVStream(adapter, config())
    load_memory(restored, tmp_path / "m")
    assert restored.stats() == saved.stats()
    for stream in (saved, restored):
        for text in TEXTS:
            stream.push_text(text)
    assert restored.stats().pinned_held == saved.stats().pinned_held == held


def _rewrite_header(path: Path, change) -> None:
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    change(header["__metadata__"])
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + size :])


def test_the_same_model_elsewhere_or_after_a_transformers_upgrade_keeps_its_memory(folders, tmp_path):
    # The fingerprint is the model's: not its folder, nor the transformers release that wrote its config.
    moved = tmp_path / "moved"
    shutil.copytree(folders["llama"], moved)
    config_file = moved / "config.json"
    written = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**written, "transformers_version": "99.0.0"}))
    path = tmp_path / "memory"
    saved = filled(load_model(folders["llama"], device="cpu", dtype="float32"))
    save_memory(saved, path)
    restored = KVStream(load_model(moved, device="cpu", dtype="float32"), config())
    load_memory(restored, path)
    assert restored.stats() == saved.stats()
    # The same model in another precision: refused for its dtype, a setting, not as another model.
    half = KVStream(load_model(folders["llama"], device="cpu", dtype="bfloat16"), config())
    with pytest.raises(MemoryFileError) as refused:
        load_memory(half, path)
    assert refused.value.kind == "settings_mismatch" and "dtype" in str(refused.value)
    # Another model (other weights, the same configuration) is still refused.
    other = KVStream(load_model(folders["llama_other"], device="cpu", dtype="float32"), config())
    with pytest.raises(MemoryFileError) as refused:
        load_memory(other, path)
    assert refused.value.kind == "model_mismatch"


def test_files_that_cannot_be_used_are_refused_with_their_reason(folders, tmp_path):
    adapter = load_model(folders["llama"], device="cpu", dtype="float32")
    good = tmp_path / "good"
    save_memory(filled(adapter), good)
    data = good.read_bytes()
    cases = {name: tmp_path / name.replace(" ", "_") for name in
             ("missing", "torn", "corrupt", "clock", "version", "not a memory", "model_mismatch", "settings_mismatch",
              "policy")}
    cases["torn"].write_bytes(data[: len(data) * 2 // 3])
    flipped = bytearray(data)
    flipped[-37] ^= 0x10
    cases["corrupt"].write_bytes(bytes(flipped))
    cases["clock"].write_bytes(data)  # a counter changed in the header: the clock is checksummed too
    _rewrite_header(cases["clock"], lambda m: m.update(stream=m["stream"].replace('"tokens_seen": ', '"tokens_seen": 1')))
    cases["version"].write_bytes(data)
    _rewrite_header(cases["version"], lambda m: m.update(version="1"))  # the layout before this one
    cases["not a memory"].write_bytes(b"\x00" * 64)
    save_memory(filled(load_model(folders["llama_other"], device="cpu", dtype="float32")), cases["model_mismatch"])
    save_memory(filled(adapter, capacity=64), cases["settings_mismatch"])
    save_memory(filled(adapter, policy="h2o"), cases["policy"])
    expected = {"missing": "missing", "torn": "torn", "corrupt": "corrupt", "clock": "corrupt", "version": "version",
                "not a memory": "corrupt", "model_mismatch": "model_mismatch",
                "settings_mismatch": "settings_mismatch", "policy": "settings_mismatch"}

    stream = filled(adapter, texts=TEXTS[:3])
    before = (stream.stats(), stream.cache.cached_seq(0).clone())
    for name, path in cases.items():
        with pytest.raises(MemoryFileError) as refused:
            load_memory(stream, path)
        assert refused.value.kind == expected[name], f"{name}: {refused.value}"
        assert str(path) in str(refused.value)
        # A refused file changes nothing.
        assert stream.stats() == before[0] and torch.equal(stream.cache.cached_seq(0), before[1]), name
    load_memory(stream, good)


def test_the_engine_restores_saves_on_close_and_sets_refused_files_aside(folders, tmp_path):
    path = tmp_path / "robot.memory"
    engine = StreamingEngine(folders["llama"], config(), device="cpu", dtype="float32", memory_file=str(path))
    engine.wait_ready(60)
    assert "no memory file" in engine.memory_status
    for text in TEXTS:
        engine.push_text(text, timeout=60)
    answer = engine.ask("Which crate holds 21 bolts?", timeout=60).text
    seen = engine.stats().tokens_seen
    engine.close()
    assert path.exists()

    again = StreamingEngine(folders["llama"], config(), device="cpu", dtype="float32", memory_file=str(path))
    again.wait_ready(60)
    assert "restored" in again.memory_status and again.stats().tokens_seen == seen
    assert again.ask("Which crate holds 21 bolts?", timeout=60).text == answer
    info = again.submit_save().result(60)
    assert info.tokens_seen == seen
    again.close()

    # Another cache size: refused, set aside (never overwritten), and the engine starts fresh.
    other = StreamingEngine(folders["llama"], config(capacity=64), device="cpu", dtype="float32",
                            memory_file=str(path))
    other.wait_ready(60)
    assert "settings_mismatch" in other.memory_status and "kept aside" in other.memory_status
    assert other.stats().tokens_seen == 0 and not path.exists()
    aside = list(tmp_path.glob("robot.memory.refused-*"))
    assert len(aside) == 2 and {p.name.endswith(".archive") for p in aside} == {True, False}, "its archive with it"
    other.close()


def test_periodic_checkpoints_save_only_a_changed_memory(folders, tmp_path):
    path = tmp_path / "m"
    engine = StreamingEngine(folders["llama"], config(), device="cpu", dtype="float32", memory_file=str(path),
                             checkpoint_period=0.2)
    engine.wait_ready(60)
    engine.push_text(TEXTS[0], timeout=60)
    deadline = time.monotonic() + 20
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), "a changed memory is saved within checkpoint_period"
    first = path.stat().st_mtime_ns
    time.sleep(0.8)
    assert path.stat().st_mtime_ns == first, "an unchanged memory is not written again"
    engine.close()
    assert engine.counters.checkpoints_failed == 0


def test_a_failing_checkpoint_is_reported_until_a_save_goes_through(folders, tmp_path):
    # The file's folder becomes impossible to make (a file stands in its place), as a full or read-only
    # disk would make a save fail; the memory goes on, and the reason stays until a save succeeds.
    blocker = tmp_path / "memories"
    engine = StreamingEngine(folders["llama"], config(), device="cpu", dtype="float32",
                             memory_file=str(blocker / "m"))
    try:
        engine.wait_ready(60)
        blocker.write_text("not a folder")
        engine.update_settings(checkpoint_period=0.2)  # from here: no save could make the folder before the file took its place
        engine.push_text(TEXTS[0], timeout=60)
        deadline = time.monotonic() + 20
        while not engine.counters.checkpoints_failed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.counters.checkpoints_failed >= 1 and "memories" in engine.save_error
        engine.push_text(TEXTS[1], timeout=60)  # the memory still takes input
        blocker.unlink()
        deadline = time.monotonic() + 20
        while engine.save_error is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.save_error is None and (blocker / "m").exists()
        assert engine.last_saved.tokens_seen == engine.stats().tokens_seen
    finally:
        engine.close()


def test_a_memory_file_that_names_a_directory_is_refused_and_the_directory_left_alone(folders, tmp_path):
    folder = tmp_path / "memories"
    folder.mkdir()
    (folder / "notes.txt").write_text("kept")
    with pytest.raises(ValueError, match="is a directory"):
        StreamingEngine(folders["llama"], config(), device="cpu", dtype="float32", memory_file=str(folder))
    assert (folder / "notes.txt").read_text() == "kept" and [p.name for p in tmp_path.iterdir()] == ["memories"]


def test_a_checkpoint_period_set_at_run_time_applies_at_once(folders, tmp_path):
    path = tmp_path / "m"
    engine = StreamingEngine(folders["llama"], config(), device="cpu", dtype="float32", memory_file=str(path))
    try:
        engine.wait_ready(60)
        engine.push_text(TEXTS[0], timeout=60)
        time.sleep(0.5)
        assert not path.exists(), "period 0: saves only on request and at close"
        engine.update_settings(checkpoint_period=0.2)  # the worker sleeps with nothing due: the new period must wake it
        deadline = time.monotonic() + 20
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert path.exists(), "a period set at run time saves a changed memory within that period"
    finally:
        engine.close()


def test_a_close_during_a_long_message_stops_it_at_its_block_and_saves_what_went_in(folders, tmp_path, monkeypatch):
    path = tmp_path / "m"
    settings = StreamConfig(capacity=48, policy="inf_mllm", chunk_size=8)
    engine = StreamingEngine(folders["llama"], settings, device="cpu", dtype="float32", memory_file=str(path))
    engine.wait_ready(60)
    engine.push_text(TEXTS[0], timeout=60)
    stream = engine.worker.stream
    before = stream.tokens_seen
    forward, blocks = stream.adapter.forward, []

    def close_at_the_second_block(*args, **kwargs):
        blocks.append(1)
        if len(blocks) == 2:
            engine.close(timeout=0)  # as a shutdown would, while a long message goes in
        return forward(*args, **kwargs)

    monkeypatch.setattr(stream.adapter, "forward", close_at_the_second_block)  # the model, once a block
    future = engine.submit_text("Later: " + " ".join(TEXTS))
    engine.worker.thread.join(60)
    assert not engine.worker.thread.is_alive()
    with pytest.raises(StreamStoppedError, match="its first 16 of"):
        future.result(0)
    assert len(blocks) == 2 and stream.tokens_seen == before + 2 * 8, "stopped at the end of the second block"
    restored = KVStream(load_model(folders["llama"], device="cpu", dtype="float32"), settings)
    info = load_memory(restored, path)
    assert info.tokens_seen == stream.tokens_seen, "the last save holds what went in"


def test_the_stream_s_time_origin_is_saved_with_the_memory_and_kept_by_a_reset(folders, tmp_path):
    adapter = load_model(folders["llama"], device="cpu", dtype="float32")
    saved = KVStream(adapter, config())
    saved.time_origin = 1_700_000_123.25
    saved.push_text(TEXTS[0], stamp=3.0)
    save_memory(saved, tmp_path / "m")
    restored = KVStream(adapter, config())
    assert restored.time_origin is None
    load_memory(restored, tmp_path / "m")
    assert restored.time_origin == 1_700_000_123.25
    restored.reset()
    assert restored.time_origin == 1_700_000_123.25, "the caller's clock goes on after a reset"


def log_files(path: Path) -> list[Path]:
    return sorted(archive_log.folder_for(path).glob("*"))


def small_archive_stream(adapter) -> KVStream:
    return KVStream(adapter, StreamConfig(capacity=48, chunk_size=16, archive_size=600, archive_block=16,
                                          system_prompt="You remember."))


@pytest.mark.parametrize("seed", range(3))
def test_each_checkpoint_appends_only_what_is_new_and_the_log_round_trips(folders, tmp_path, monkeypatch, seed):
    monkeypatch.setattr(archive_log, "SEGMENT_BYTES", 30_000)  # several segments, the oldest retired
    adapter = load_model(folders["llama"], device="cpu", dtype="float32")
    stream, rng, path = small_archive_stream(adapter), random.Random(seed), tmp_path / "m"
    largest = 0
    for checkpoint in range(14):
        seen = stream.tokens_seen
        for _ in range(rng.randint(1, 5)):
            stream.push_text(rng.choice(TEXTS) + " " * rng.randint(0, 3), stamp=float(checkpoint))
        info = save_memory(stream, path)
        appended = info.bytes - path.stat().st_size
        largest = max(largest, appended)
        new = stream.tokens_seen - seen
        per_token = stream.archive.bytes_per_token()
        # What is new and little else: packed, the keys' and values' top bytes compressed (at most a quarter off).
        assert new * (per_token - 16) * 0.7 <= appended <= new * per_token + 4096, (checkpoint, new, appended)
        restored = small_archive_stream(adapter)
        assert load_memory(restored, path).blocks_lost == 0
        before, after = stream.archive.export_state(), restored.archive.export_state()
        assert before.keys() == after.keys()
        for name in before:
            torch.testing.assert_close(before[name], after[name], rtol=0, atol=0, equal_nan=True)
        assert restored.stats() == stream.stats()
    assert stream.archive.blocks_dropped > 0
    # Retired segments are gone: the files hold at most the archive's bound, the oldest segment's blocks that left
    # it, and the newest segment (each segment at most one append past its size).
    named = json.loads(_header(path)["archive_log"])["segments"]
    assert [p.name for p in log_files(path)] == sorted(name for name, _, _ in named)
    held_bytes = stream.archive.size * stream.archive.bytes_per_token()
    assert sum(p.stat().st_size for p in log_files(path)) <= held_bytes + 2 * (archive_log.SEGMENT_BYTES + largest)
    # A save to an empty place (or of another memory) writes every block held.
    elsewhere = save_memory(stream, tmp_path / "copy")
    assert elsewhere.bytes > stream.archive.tokens * (stream.archive.bytes_per_token() - 16) * 0.7


@pytest.mark.parametrize("seed", range(3))
def test_packed_records_round_trip_and_unpacked_ones_are_still_read(tmp_path, seed):
    rng = np.random.default_rng(seed)
    for width in (1, 2, 4, 8):
        for size in (0, 1, 7, int(rng.integers(900, 1100))):
            payload = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            assert archive_log.unpack_payload(archive_log.pack_payload(payload, width)) == payload
    floats = rng.standard_normal(4096).astype(np.float32).tobytes()
    packed = archive_log.pack_payload(floats, 4)
    assert len(packed) < 0.9 * len(floats), "the top bytes of floats compress"
    for damaged in (packed[:-5], packed[:30] + bytes(8) + packed[38:]):
        with pytest.raises(ValueError):
            archive_log.unpack_payload(damaged)

    def state(first: int) -> dict[str, torch.Tensor]:
        return {"archive.keys": torch.from_numpy(rng.standard_normal((2, 1, 3, 4)).astype(np.float32)),
                "archive.blocks": torch.tensor([[first, 3, 0, 0, 0, 0]])}

    # A segment written before records were packed: its record is read, and packed ones follow it.
    old = state(0)
    payload = archive_log.st_save(old)
    record = archive_log.RECORD.pack(archive_log.MAGIC, len(payload), hashlib.sha256(payload).digest()) + payload
    name = f"m-000000{archive_log.SUFFIX}"
    (tmp_path / name).write_bytes(record)
    log = archive_log.ArchiveLog("m", [archive_log.Segment(name, len(record), 0)])
    new = state(1)
    log.append(tmp_path, new)
    records, damaged = log.read(tmp_path)
    assert not damaged and len(records) == 2
    for saved, read in zip((old, new), records):
        assert all(torch.equal(saved[k], read[k]) for k in saved)


def _header(path: Path) -> dict:
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size])["__metadata__"]


@pytest.mark.parametrize("where", ["first record", "last record"])
def test_a_damaged_log_costs_only_the_blocks_from_the_damage_on(folders, tmp_path, where):
    adapter = load_model(folders["llama"], device="cpu", dtype="float32")
    stream, path = small_archive_stream(adapter), tmp_path / "m"
    held = []
    for checkpoint in range(3):
        for text in TEXTS[checkpoint * 3 : checkpoint * 3 + 3]:
            stream.push_text(text, stamp=float(checkpoint))
        save_memory(stream, path)
        held.append(len(stream.archive.blocks))
    (segment,) = log_files(path)
    committed = segment.stat().st_size
    # Bytes past the committed length (an append a crash cut short) are never read, and the next append cuts them.
    with open(segment, "ab") as f:
        f.write(b"\x07" * 100)
    restored = small_archive_stream(adapter)
    assert load_memory(restored, path).blocks_lost == 0 and len(restored.archive.blocks) == held[-1]
    restored.push_text(TEXTS[9])
    info = save_memory(restored, path)
    assert segment.stat().st_size == committed + info.bytes - path.stat().st_size
    # A flipped byte: the records before it load, the rest are counted lost; the cache is whole.
    data = bytearray(segment.read_bytes())
    record = archive_log.RECORD
    offsets = [0]
    while offsets[-1] < len(data):
        offsets.append(offsets[-1] + record.size + record.unpack_from(data, offsets[-1])[1])
    damaged = 0 if where == "first record" else len(offsets) - 2
    data[(offsets[damaged] + offsets[damaged + 1]) // 2] ^= 0x20
    segment.write_bytes(bytes(data))
    again = small_archive_stream(adapter)
    info = load_memory(again, path)
    kept = 0 if damaged == 0 else held[damaged - 1]
    assert len(again.archive.blocks) == kept and info.blocks_lost == len(restored.archive.blocks) - kept
    assert again.stats().fill == restored.stats().fill and again.tokens_seen == restored.tokens_seen
    assert torch.equal(again.cache.cached_seq(0), restored.cache.cached_seq(0))


WRITER = """
import sys, torch
from inf_mllm_ros.engine.persistence import archive_log
from inf_mllm_ros.engine.models.loading import load_model
from inf_mllm_ros.engine.persistence.memory_file import save_memory
from inf_mllm_ros.engine.runtime.stream import KVStream
from inf_mllm_ros.engine.stream_config import StreamConfig
from inf_mllm_ros.engine.answering import StreamStoppedError
torch.set_num_threads(1)
log = sys.argv[3] == "log"
if log:  # mostly appending to the archive's log, its segments rolling over and retired
    archive_log.SEGMENT_BYTES = 1 << 20
config = StreamConfig(capacity=256 if log else 2048, policy="inf_mllm", chunk_size=256, system_prompt="x",
                      archive_size=4096 if log else 32768)
stream = KVStream(load_model(sys.argv[1], device="cpu", dtype="float32"), config)
while stream.cache.fill < config.capacity:
    stream.push_text("word " * 300)
round = 0
while True:  # file: mostly writing the file of about 13 MB per short message; log: appending 300 words' blocks
    round += 1
    stream.push_text(("word " * 300 + str(round)) if log else str(round))
    save_memory(stream, sys.argv[2])
    print(stream.tokens_seen, flush=True)
"""


@pytest.mark.parametrize("mode, seed", [(mode, seed) for mode in ("file", "log") for seed in range(3)])
def test_a_writer_killed_mid_write_leaves_a_loadable_file(folders, tmp_path, mode, seed):
    path = tmp_path / "memory"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(folders["llama_small"]), str(path), mode],
                              stdout=subprocess.PIPE, text=True)
    try:
        saved = [int(writer.stdout.readline())]  # one complete save, then a kill at a random moment
        time.sleep(random.Random(seed).uniform(0.0, 0.3))
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(10)
        saved += [int(line) for line in writer.stdout.read().split()]
    finally:
        writer.kill()
    adapter = load_model(folders["llama_small"], device="cpu", dtype="float32")
    stream = KVStream(adapter, StreamConfig(capacity=256 if mode == "log" else 2048, policy="inf_mllm", chunk_size=256,
                                            system_prompt="x", archive_size=4096 if mode == "log" else 32768))
    info = load_memory(stream, path)
    assert info.blocks_lost == 0 and stream.archive.tokens > 0
    save_memory(stream, path)
    assert not list(tmp_path.glob(".*.tmp")), "the next save clears what a killed writer left"
    named = json.loads(_header(path)["archive_log"])["segments"]
    assert [p.name for p in log_files(path)] == sorted(name for name, _, _ in named), "and segments no file names"
    # The last save reported, or the next one if its rename had happened when the kill came.
    assert info.tokens_seen >= saved[-1], (info, saved)
    assert not stream.cache.fill == 0


def test_a_periodic_checkpoint_holds_the_model_only_for_the_copy(folders, tmp_path, monkeypatch):
    """The memory is copied on the worker and written on a thread of its own: the model goes on while the file is
    written, and the file holds the memory as it was copied."""
    adapter = load_model(folders["llama"], device="cpu", dtype="float32")
    stream, path = small_archive_stream(adapter), tmp_path / "m"
    for text in TEXTS[:4]:
        stream.push_text(text)
    started, release = threading.Event(), threading.Event()
    write = checkpoints.write_memory

    def slow_write(snapshot):
        started.set()
        assert release.wait(20)
        return write(snapshot)

    monkeypatch.setattr(checkpoints, "write_memory", slow_write)
    saver = checkpoints.Checkpointer(str(path))
    saver.restore(stream, 60.0)  # no file yet: starts fresh
    copied = stream.tokens_seen
    assert saver.checkpoint(stream, 60.0)  # back while the write waits
    assert started.wait(20) and not path.exists()
    stream.push_text(TEXTS[4])  # the model goes on meanwhile
    release.set()
    assert saver.wait() and saver.save_error is None
    assert saver.last_saved.held_s < saver.last_saved.seconds
    restored = small_archive_stream(adapter)
    assert load_memory(restored, path).tokens_seen == copied < stream.tokens_seen
    # At close the write is waited for: the file then holds everything that went in.
    assert saver.checkpoint(stream, 60.0, wait=True) and saver.last_saved.tokens_seen == stream.tokens_seen
