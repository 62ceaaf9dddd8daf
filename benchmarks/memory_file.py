"""Save and load time and file size of the memory file, per cache size; and what a checkpoint writes.

    python benchmarks/memory_file.py [--caches 256 1024 4096] [--model smollm2] [--dtype float32]
    python benchmarks/memory_file.py --checkpoint [--model qwen2.5-0.5b] [--new-tokens 1024]

`--checkpoint`: the shipped settings (cache 1024, archive 32K tokens), the archive filled to its bound (its
blocks written again, `common.tile_archive`), saved once; then `--new-tokens` tokens of text pushed and saved
again: the bytes that second save wrote, how long it took and how long of that the memory was being copied (all a
periodic save holds the model for: the engine writes the copy on a thread of its own), and the same for a save to
a new place (the whole memory). Results: benchmarks/results/memory_file_checkpoint.json.

Each cache is filled from the shared novel (pushed in 128-token chunks, evicting as it goes), then
saved and loaded into a fresh stream of the same settings `--repeats` times (median reported). The
file goes to a temporary folder on the same disk as the results. Results:
benchmarks/results/memory_file.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from common import RESULTS, machine, read_text, tile_archive, write_records


def checkpoint(args) -> None:
    import json
    import time

    import torch

    from inf_mllm_ros.engine.models.loading import load_model
    from inf_mllm_ros.engine.persistence.memory_file import model_fingerprint, save_memory
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.engine.stream_config import StreamConfig

    torch.set_num_threads(2)
    adapter = load_model(args.model, device="cpu", dtype=args.dtype)
    fingerprint = model_fingerprint(adapter)
    ids = adapter.tokenize(read_text(args.text))
    stream = KVStream(adapter, StreamConfig())
    stream.push_tokens(ids[:2048])
    tile_archive(stream, stream.archive.size)
    record = {"model": args.model, "dtype": args.dtype, "device": machine(), "capacity": stream.config.capacity,
              "archive_tokens": stream.archive.tokens, "archive_size": stream.archive.size,
              "bytes_per_archived_token": stream.archive.bytes_per_token(), "new_tokens": args.new_tokens}
    with tempfile.TemporaryDirectory(dir=RESULTS) as folder:
        first = save_memory(stream, f"{folder}/m", fingerprint)
        record["first_save_bytes"], record["first_save_s"] = first.bytes, round(first.seconds, 3)
        start = stream.tokens_seen
        while stream.tokens_seen - start < args.new_tokens:
            stream.push_tokens(ids[stream.tokens_seen % (len(ids) - 512):][:min(256, args.new_tokens)])
        record["new_tokens"] = stream.tokens_seen - start
        began = time.monotonic()
        again = save_memory(stream, f"{folder}/m", fingerprint)
        record["checkpoint_bytes"], record["checkpoint_s"] = again.bytes, round(time.monotonic() - began, 3)
        record["checkpoint_held_s"] = round(again.held_s, 3)  # the copy: what a periodic save holds the model for
        whole = save_memory(stream, f"{folder}/whole", fingerprint)
        record["whole_memory_bytes"], record["whole_memory_s"] = whole.bytes, round(whole.seconds, 3)
    print(record, flush=True)
    (RESULTS / "memory_file_checkpoint.json").write_text(json.dumps(record, indent=1) + "\n")


# The options of a few seconds' run on the small models (run.py --smoke).
SMOKE = ["--caches", "128", "--repeats", "1"]


def main(argv: list[str] | None = None) -> None:
    import torch

    from inf_mllm_ros.engine.models.loading import load_model
    from inf_mllm_ros.engine.persistence.memory_file import load_memory, model_fingerprint, save_memory
    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.engine.stream_config import StreamConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--caches", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--text", default=None)
    p.add_argument("--checkpoint", action="store_true")
    p.add_argument("--new-tokens", type=int, default=1024)
    args = p.parse_args(argv)
    if args.checkpoint:
        return checkpoint(args)
    torch.set_num_threads(1)
    adapter = load_model(args.model, device="cpu", dtype=args.dtype)
    fingerprint = model_fingerprint(adapter)
    ids = adapter.tokenize(read_text(args.text))
    records = []
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=RESULTS) as folder:
        for cache in args.caches:
            config = StreamConfig(capacity=cache, chunk_size=128, system_prompt="")
            stream = KVStream(adapter, config)
            stream.push_tokens(ids[: cache + 256])
            path = f"{folder}/memory_{cache}"
            saves, loads = [], []
            for _ in range(args.repeats):
                saved = save_memory(stream, path, fingerprint)
                loaded = load_memory(KVStream(adapter, config), path, fingerprint)
                saves.append(saved.seconds)
                loads.append(loaded.seconds)
            records.append({
                "cache_size": cache, "policy": config.policy, "model": args.model, "dtype": args.dtype,
                "file_bytes": saved.bytes, "kv_bytes": stream.cache.kv_nbytes(),
                "bytes_per_token": round(saved.bytes / cache), "save_seconds_median": round(statistics.median(saves), 4),
                "load_seconds_median": round(statistics.median(loads), 4), "repeats": args.repeats,
                "device": machine(),
            })
            r = records[-1]
            print(f"cache {cache:5d}: {r['file_bytes'] / 1e6:7.1f} MB, save {r['save_seconds_median']:.3f} s, "
                  f"load {r['load_seconds_median']:.3f} s", flush=True)
    write_records("memory_file.json", records)


if __name__ == "__main__":
    main()
