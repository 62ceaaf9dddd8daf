"""Save and load time and file size of the memory file, per cache size.

    python benchmarks/memory_file.py [--caches 256 1024 4096] [--model smollm2] [--dtype float32]

Each cache is filled from the shared novel (pushed in 128-token chunks, evicting as it goes), then
saved and loaded into a fresh stream of the same settings `--repeats` times (median reported). The
file goes to a temporary folder on the same disk as the results. Results:
benchmarks/results/memory_file.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from common import RESULTS, machine, read_text, write_records


def main() -> None:
    import torch

    from inf_mllm_ros.engine.loading import load_model
    from inf_mllm_ros.engine.memory_file import load_memory, model_fingerprint, save_memory
    from inf_mllm_ros.engine.stream import KVStream, StreamConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--caches", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--text", default=None)
    args = p.parse_args()
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
