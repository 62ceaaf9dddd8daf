"""The engine's speed on a GPU (or the CPU), with random weights of real shapes: no weights needed.

For each shape (testing/random_models.py SHAPES: the embedded default with its frames, a 2B VLM, a 7B text model):
- decode: ms per answer token, eager (a forward through the cache per token), the static step and the compiled
  step (engine/memory/decode_step.py), and transformers' own `generate` on the same model; the floor is the bytes read
  per token (decoder and output layer) over the device's measured copy bandwidth;
- ms per 64-token chunk once the cache is full, per eviction policy (the archive on, input eager), and for the
  default policy through the ingest step eager, static and compiled (engine/memory/ingest_step.py);
- ms per 640x480 frame (shapes that take frames);
- answer latency (16 tokens, the shipped decode step) with 0, 16K and 64K archived tokens.
Each token time is the difference of two answers, 1 and n+1 tokens long, over n: the question's own cost
cancels. Results (naming the device) are written after each shape.

    python benchmarks/gpu_speed.py                                   # CUDA, bfloat16: default, vlm-2b, text-7b
    python benchmarks/gpu_speed.py --device cpu --shapes tiny default  # float32 on the CPU
    python benchmarks/gpu_speed.py --smoke --out /tmp/smoke.json     # tiny, a few steps (the tests run it)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from common import RESULTS, machine, synchronize, tile_archive

ARCHIVED = (0, 16384, 65536)
QUESTION = "What is the access code of the blue cabinet?"


def bandwidth(device) -> float:
    """Bytes per second a device copy moves (read plus write), the best of a few copies of a large tensor."""
    import torch

    size = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size / best


def bytes_per_token(adapter) -> int:
    """Weights a decode step reads: the decoder's layers and final norm, and the output layer."""
    decoder = adapter.decoder
    tensors = {id(p): p for part in (decoder.layers, decoder.norm, adapter.model.lm_head) for p in part.parameters()}
    return sum(p.numel() * p.element_size() for p in tensors.values())


def filled_stream(adapter, tokens: int, **config):
    """A stream past `tokens` tokens of random ids in 64-token chunks (the cache full and evicting)."""
    import torch

    from inf_mllm_ros.engine.runtime.stream import KVStream
    from inf_mllm_ros.engine.stream_config import StreamConfig

    stream = KVStream(adapter, StreamConfig(**config))
    stream.push_text("The access code of the blue cabinet is 4417.")
    generator = torch.Generator().manual_seed(0)
    vocab = len(adapter.tokenizer)
    while stream.tokens_seen < tokens:
        stream.push_tokens(torch.randint(8, vocab, (64,), generator=generator))
    return stream


def median_latency(stream, max_new: int, repeats: int) -> float:
    return statistics.median(stream.ask(QUESTION, max_new_tokens=max_new).latency for _ in range(repeats))


def decode_ms(stream, tokens: int, repeats: int) -> float:
    """Milliseconds per answer token: the difference of answers of 1 and up to tokens + 1 tokens over the
    tokens between them (a random model may stop early; the first answer warms up, and compiles where the
    step is compiled)."""
    stream.ask(QUESTION, max_new_tokens=tokens + 1)
    long = [stream.ask(QUESTION, max_new_tokens=tokens + 1) for _ in range(repeats)]
    short = median_latency(stream, 1, repeats)
    return 1000 * statistics.median((a.latency - short) / max(1, a.tokens_generated - 1) for a in long)


def generate_ms(adapter, tokens: int, repeats: int, prompt: int = 1024) -> float:
    """transformers' `generate` (greedy, its own dynamic cache) after a prompt of `prompt` tokens: ms per token."""
    import torch

    ids = torch.randint(8, len(adapter.tokenizer), (1, prompt), generator=torch.Generator().manual_seed(1))
    ids = ids.to(adapter.device)

    def run(n: int) -> float:
        synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            adapter.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                   min_new_tokens=n, do_sample=False, pad_token_id=0)
        synchronize()
        return time.perf_counter() - start

    run(2)
    long = statistics.median(run(tokens + 1) for _ in range(repeats))
    short = statistics.median(run(1) for _ in range(repeats))
    return 1000 * (long - short) / tokens


def chunk_ms(adapter, policy: str, chunks: int, capacity: int) -> float:
    """Milliseconds per 64-token chunk once the cache is full, with eviction by `policy` and the archive on."""
    import torch

    # Eager input for every policy: a compiled step would be one more compile (a minute on a GPU) per policy.
    stream = filled_stream(adapter, capacity + 256, capacity=capacity, policy=policy, ingest_step="eager")
    generator = torch.Generator().manual_seed(2)
    times = []
    for _ in range(chunks):
        ids = torch.randint(8, len(adapter.tokenizer), (64,), generator=generator)
        synchronize()
        start = time.perf_counter()
        stream.push_tokens(ids)
        synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def ingest_ms(stream, chunks: int) -> float:
    """Milliseconds per 64-token chunk through the stream's own cache (full and evicting) as it is set up."""
    import torch

    generator = torch.Generator().manual_seed(3)
    times = []
    for _ in range(chunks + 1):
        ids = torch.randint(8, len(stream.adapter.tokenizer), (64,), generator=generator)
        synchronize()
        start = time.perf_counter()
        stream.push_tokens(ids)
        synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


def frame_ms(stream, frames: int) -> float:
    import numpy as np

    rng = np.random.default_rng(0)
    times = []
    for i in range(frames + 2):
        rgb = rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)
        synchronize()
        start = time.perf_counter()
        stream.push_frame(rgb, stamp=float(i))
        synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[2:])


def measure(shape: str, args, record: dict) -> dict:
    import torch

    from inf_mllm_ros.engine.memory.decode_step import StaticDecoder
    from inf_mllm_ros.engine.memory.ingest_step import StaticIngester
    from inf_mllm_ros.engine.memory.policies import POLICIES
    from inf_mllm_ros.testing.random_models import random_adapter

    device = torch.device(args.device)
    adapter = random_adapter(shape, device=device, dtype=getattr(torch, args.dtype))
    weight = bytes_per_token(adapter)
    out = {"bytes_per_token": weight, "floor_ms": 1000 * weight / record["bandwidth_bytes_per_s"]}
    stream = filled_stream(adapter, args.stream_tokens, capacity=args.capacity, archive_size=max(ARCHIVED))
    # As shipped: None (eager) on a CPU, on CUDA the compiled step, made ready by the stream's first input. One
    # compiled step per shape: each compile takes about a minute.
    shipped, retrieve, evidence = stream.static_decoder, stream.config.retrieve_tokens, stream.config.evidence
    decoders = {"eager": None, "static": StaticDecoder(adapter, stream.cache, "static"),
                "compiled": shipped if shipped is not None and shipped.mode == "compiled"
                else StaticDecoder(adapter, stream.cache, "compiled")}
    stream.reconfigure(retrieve_tokens=0, evidence=0)  # decoding alone
    for mode, decoder in decoders.items():
        stream.static_decoder = decoder
        out[f"decode_ms_{mode}"] = decode_ms(stream, args.tokens, args.repeats)
        print(shape, mode, round(out[f"decode_ms_{mode}"], 3), "ms/token", flush=True)
    out["decode_ms_transformers_generate"] = generate_ms(adapter, args.tokens, args.repeats)
    for key in [k for k in out if k.startswith("decode_ms_")]:
        out[key.replace("decode_ms_", "tokens_per_s_")] = 1000 / out[key] if out[key] > 0 else None
    # Answers as shipped: the decode step "auto" gives this device, retrieval from the archive.
    stream.static_decoder = shipped
    out["decode_step_shipped"] = "eager" if shipped is None else shipped.mode
    stream.ask(QUESTION, max_new_tokens=16)  # warm-up (and the compile, where compiled)
    answers = {"0": median_latency(stream, 16, args.repeats)}
    stream.reconfigure(retrieve_tokens=retrieve, evidence=evidence)
    stream.ask(QUESTION, max_new_tokens=16)  # the model's retrieval heads are found at its first retrieval
    for archived in ARCHIVED[1:] if not args.smoke else (512, 2048):
        tile_archive(stream, archived)
        answers[str(archived)] = median_latency(stream, 16, args.repeats)
    out["answer_s_by_archived_tokens"] = answers
    out["answer_ratio_largest_archive"] = answers[list(answers)[-1]] / answers["0"]
    print(shape, "answers", answers, flush=True)
    # An input's 64-token chunk through the ingest step, eager, static and compiled, over the same stream. As shipped
    # on CUDA the compiled step, made with the first input; elsewhere two padded sizes (64 and the chunk), so that a
    # CPU compiles twice, not once per power of two.
    shipped_ingest = stream.static_ingester
    out["ingest_step_shipped"] = "eager" if shipped_ingest is None else shipped_ingest.mode
    chunk = stream.config.chunk_size
    sizes = (64, chunk) if chunk > 64 else (chunk,)
    ingesters = {"eager": None, "static": StaticIngester(adapter, stream.cache, chunk, "static", sizes=sizes),
                 "compiled": shipped_ingest if shipped_ingest is not None and shipped_ingest.mode == "compiled"
                 else StaticIngester(adapter, stream.cache, chunk, "compiled", sizes=sizes)}
    for mode, ingester in ingesters.items():
        if ingester is not None:
            ingester.warm_up()
        stream.static_ingester = ingester
        out[f"ingest_chunk_ms_{mode}"] = ingest_ms(stream, args.chunks)
        print(shape, "ingest", mode, round(out[f"ingest_chunk_ms_{mode}"], 3), "ms/64-token chunk", flush=True)
    stream.static_ingester = shipped_ingest
    out["chunk_ms"] = {name: chunk_ms(adapter, name, args.chunks, args.capacity)
                       for name in sorted(POLICIES) if name != "full"}
    out["chunk_ratio_inf_mllm_to_streaming_llm"] = out["chunk_ms"]["inf_mllm"] / out["chunk_ms"]["streaming_llm"]
    print(shape, "chunks", out["chunk_ms"], flush=True)
    if adapter.supports_frames:
        out["frame_ms_640x480"] = frame_ms(stream, args.frames)
        out["frames_per_s"] = 1000 / out["frame_ms_640x480"]
    return out


# The options of a few seconds' run on the small models (run.py --smoke).
SMOKE = ["--smoke"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--shapes", nargs="+", default=None, help="default: default vlm-2b text-7b (CPU: tiny default)")
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--stream-tokens", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=64, help="answer tokens timed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU, a few steps")
    ap.add_argument("--out", default=None, help="default: results/gpu_speed_<device>.json")
    args = ap.parse_args(argv)
    import torch

    if args.smoke:
        args.device, args.shapes, args.capacity, args.stream_tokens = "cpu", ["tiny"], 64, 256
        args.tokens, args.repeats, args.chunks, args.frames = 8, 1, 2, 1
    cpu = torch.device(args.device).type == "cpu"
    args.dtype = args.dtype or ("float32" if cpu else "bfloat16")
    args.shapes = args.shapes or (["tiny", "default"] if cpu else ["default", "vlm-2b", "text-7b"])
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else RESULTS / f"gpu_speed_{'cpu' if cpu else 'cuda'}.json"
    name = f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)" if cpu else machine()
    record = {"device": name, "dtype": args.dtype,
              "torch": torch.__version__, "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "bandwidth_bytes_per_s": bandwidth(torch.device(args.device)), "shapes": {}}
    for shape in args.shapes:
        record["shapes"][shape] = measure(shape, args, record)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
