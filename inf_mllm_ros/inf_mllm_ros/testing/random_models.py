"""Vision-language model folders with random weights, built from each family's config classes.

Trained vision-language weights are not always at hand (CI, a fresh machine), so tests and benchmarks
build models of the right shape with random weights, save them with `save_pretrained` together with a
processor, and load them by path like real ones. Their outputs mean nothing; their code paths, shapes
and costs are those of the real families. Only tests and benchmarks use it; the embedded default model
(loading.py) shares the Idefics3 shape with it through vlm_parts.py.

    build_model_folder("qwen2_vl", folder)                      # tiny, for tests
    build_model_folder("qwen2_vl", folder, size="qwen2-vl-2b")  # Qwen2-VL-2B shapes, for GPU benchmarks
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..engine.models.adapters.base import image_only_processor_class
from ..engine.models.vlm_parts import IDEFICS3_TOKENS, idefics3_parts

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava", "llava_onevision", "idefics3")
TEXT_FAMILIES = ("llama",)
SIZES = ("tiny", "small", "qwen2.5-0.5b", "qwen2-vl-2b", "qwen2.5-7b")
# Shapes the speed benchmarks run (benchmarks/gpu_speed.py): (family, decoder size). "default" is the embedded
# default's whole shape: LLaVA-OneVision's vision part around Qwen2.5-0.5B's decoder and vocabulary.
SHAPES = {"tiny": ("llava_onevision", "tiny"), "default": ("default", "qwen2.5-0.5b"),
          "vlm-2b": ("qwen2_vl", "qwen2-vl-2b"), "text-7b": ("llama", "qwen2.5-7b")}
# Qwen2.5's vocabulary: the output layer of the real shapes costs what theirs does.
QWEN_VOCAB = 151936

_CORPUS = [
    "You are the memory of a mobile robot. Camera frames and messages arrive with their time in seconds.",
    "Answer questions about what happened briefly and precisely.",
    "Describe briefly what the robot sees and what happened most recently.",
    "A person in a red jacket carries a box past the loading door; the forklift waits by shelf 4.",
    "What is on the table? Where did the person go? How many boxes are there? The time is 0:01:23.4.",
]

# Video processors need torchvision, which is optional: processors are built with their image part only.
# Chat templates in each family's own style. The image placeholder is what the processor expands.
_CHATML_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}IMAGE{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
)
_CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n" + _CHATML_CONTENT + "<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_LLAVA = (  # llava-1.5 style: list content only, images first
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'][0]['text'] }}\n"
    "{% else %}{{ message['role'].upper() }}: {% for c in message['content'] %}{% if c['type'] == 'image' %}"
    "<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% if message['role'] == 'assistant' %}</s>{% endif %}"
    "{{ '\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
_SMOLVLM = (  # SmolVLM style: list content only
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% else %}<image>{% endif %}"
    "{% endfor %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)



def synthetic_tokenizer(special_tokens: list[str], chat_template: str, vocab_size: int = 400):
    """A small byte-level BPE tokenizer trained on a few sentences (any text encodes; words are short)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    base = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    specials = base + [t for t in special_tokens if t not in base]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>",
        bos_token="<|im_start|>",
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def _text_sizes(size: str) -> dict:
    """Decoder shapes: tiny for tests, small for CPU benchmarks, the default's and Qwen2-VL-2B's for GPU
    benchmarks."""
    if size == "tiny":
        return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=4096)
    if size == "small":  # SmolLM2-135M's layers (SmolVLM's decoder), 4 of its 30
        return dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=9,
                    num_key_value_heads=3, max_position_embeddings=8192)
    if size == "qwen2.5-0.5b":  # the embedded default's decoder
        return dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, max_position_embeddings=32768)
    if size == "qwen2-vl-2b":
        return dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                    num_key_value_heads=2, max_position_embeddings=32768)
    if size == "qwen2.5-7b":
        return dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                    num_key_value_heads=4, max_position_embeddings=32768, vocab_size=QWEN_VOCAB)
    raise ValueError(f"unknown size {size!r}; choose one of {SIZES}")


def _finish(model, processor, folder: Path | None):
    """The model and its processor saved in `folder` (returned), or, without a folder, the two themselves."""
    if folder is None:
        return model, processor
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def _init(model_cls, config, seed: int, dtype: torch.dtype, device: str | torch.device = "cpu"):
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate in the target dtype: a 2B model in float32 is 9 GB
    try:
        with torch.device(device):  # made where it runs: a 7B model's random weights in seconds on a GPU
            return model_cls(config).eval()
    finally:
        torch.set_default_dtype(default)


def build_qwen2_vl(folder: Path | None, *, size: str = "tiny", seed: int = 0, v2_5: bool = False,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Qwen2-VL (or Qwen2.5-VL): M-RoPE decoder, 14-pixel patches merged 2x2 into one token."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil, Qwen2VLProcessor)

    special = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer = synthetic_tokenizer(special, _CHATML.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>"))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special}
    text = _text_sizes(size)
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    # M-RoPE sections split head_dim / 2 frequencies over (time, height, width); 2B uses [16, 24, 24].
    half = head_dim // 2
    section = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]
    text.update(vocab_size=len(tokenizer), rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                             "mrope_section": section},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    big = size == "qwen2-vl-2b"
    if big:  # Qwen2-VL-2B's vocabulary and tied head (our tokenizer uses only the first ids)
        text["vocab_size"] = 151936
    width, depth, heads = (1280, 32, 16) if big else (32, 2, 2)
    common = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, depth=depth, num_heads=heads)
    token_ids = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                     vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if v2_5:
        vision = dict(common, hidden_size=width, intermediate_size=width * 2 if not big else 3420,
                      out_hidden_size=text["hidden_size"], window_size=112, fullatt_block_indexes=[depth - 1])
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **token_ids)
        model_cls = Qwen2_5_VLForConditionalGeneration
    else:
        vision = dict(common, embed_dim=width, hidden_size=text["hidden_size"], mlp_ratio=4)
        config = Qwen2VLConfig(text_config=text, vision_config=vision, **token_ids)
        model_cls = Qwen2VLForConditionalGeneration
    config.tie_word_embeddings = big
    model = _init(model_cls, config, seed, dtype, device)
    min_pixels, max_pixels = (56 * 56, 28 * 28 * 1280) if big else (28 * 28, 28 * 28 * 16)
    image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
                                               patch_size=14, merge_size=2, temporal_patch_size=2)
    processor = image_only_processor_class(Qwen2VLProcessor)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template)
    return _finish(model, processor, folder)


def build_llava(folder: Path | None, *, size: str = "tiny", seed: int = 0, onevision: bool = False,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """LLaVA-1.5 (CLIP tower, fixed resolution) or LLaVA-OneVision (SigLIP tower, any-resolution tiles)."""
    from transformers import (LlavaConfig, LlavaForConditionalGeneration, LlavaOnevisionConfig,
                              LlavaOnevisionForConditionalGeneration, LlavaOnevisionProcessor, LlavaProcessor)

    image, patch = (32, 8) if size != "qwen2-vl-2b" else (336, 14)
    text = _text_sizes(size)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=image, patch_size=patch)
    if onevision:
        from transformers import LlavaOnevisionImageProcessorPil

        tokenizer = synthetic_tokenizer(["<image>", "<video>"], _CHATML.replace("IMAGE", "<image>"))
        text.update(model_type="qwen2", vocab_size=len(tokenizer))
        pinpoints = [[image * r, image * c] for r in (1, 2) for c in (1, 2)]
        config = LlavaOnevisionConfig(
            text_config=text, vision_config=dict(vision, model_type="siglip_vision_model", vision_use_head=False),
            image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
            video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
            image_grid_pinpoints=pinpoints, vision_feature_select_strategy="full", vision_feature_layer=-1,
        )
        model = _init(LlavaOnevisionForConditionalGeneration, config, seed, dtype, device)
        image_processor = LlavaOnevisionImageProcessorPil(
            size={"height": image, "width": image}, image_grid_pinpoints=pinpoints)
        processor = image_only_processor_class(LlavaOnevisionProcessor)(
            image_processor=image_processor, tokenizer=tokenizer, num_image_tokens=(image // patch) ** 2,
            vision_feature_select_strategy="full", chat_template=tokenizer.chat_template)
    else:
        from transformers import CLIPImageProcessorPil

        tokenizer = synthetic_tokenizer(["<image>", "</s>"], _LLAVA)
        text.update(model_type="llama", vocab_size=len(tokenizer))
        config = LlavaConfig(
            text_config=text, vision_config=dict(vision, model_type="clip_vision_model", projection_dim=32),
            image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
            image_seq_length=(image // patch) ** 2, vision_feature_select_strategy="default", vision_feature_layer=-2,
        )
        model = _init(LlavaForConditionalGeneration, config, seed, dtype, device)
        image_processor = CLIPImageProcessorPil(size={"shortest_edge": image},
                                                crop_size={"height": image, "width": image})
        processor = LlavaProcessor(
            image_processor=image_processor, tokenizer=tokenizer, patch_size=patch, num_additional_image_tokens=1,
            vision_feature_select_strategy="default", chat_template=tokenizer.chat_template)
    return _finish(model, processor, folder)


def build_idefics3(folder: Path | None, *, size: str = "tiny", seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu"):
    """SmolVLM / Idefics3: SigLIP-style tower, pixel shuffle, image split into tiles plus a global view."""
    from transformers import Idefics3ForConditionalGeneration

    tokenizer = synthetic_tokenizer(IDEFICS3_TOKENS, _SMOLVLM)
    text = _text_sizes(size)
    text.update(model_type="llama", bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    if size == "tiny":
        shape = dict(image_size=32, patch_size=8, scale_factor=2, vision_width=32, vision_layers=2)
    else:
        shape = dict(image_size=64, patch_size=8, scale_factor=2, vision_width=64, vision_layers=2)
    text["vocab_size"] = len(tokenizer)
    config, processor = idefics3_parts(tokenizer, text, **shape)
    model = _init(Idefics3ForConditionalGeneration, config, seed, dtype, device)
    return _finish(model, processor, folder)


def build_llama(folder: Path | None, *, size: str = "tiny", seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu"):
    """A text-only Llama (the shape of SmolLM2), for what frames must not reach."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = synthetic_tokenizer([], _CHATML.replace("IMAGE", ""))
    config = LlamaConfig(**{"vocab_size": len(tokenizer), **_text_sizes(size)}, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = _init(LlamaForCausalLM, config, seed, dtype, device)
    return _finish(model, tokenizer, folder)


def build_default_shape(folder: Path | None, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu"):
    """The embedded default's shape with random weights: LLaVA-OneVision's vision part (as the default has it)
    around Qwen2.5-0.5B's decoder, vocabulary and tied output layer."""
    from transformers import LlavaOnevisionForConditionalGeneration

    from ..engine.models.embedded_models import ONEVISION_VISION
    from ..engine.models.vlm_parts import onevision_parts

    tokenizer = synthetic_tokenizer(["<image>", "<video>"], _CHATML.replace("IMAGE", "<image>"))
    text = dict(_text_sizes("qwen2.5-0.5b"), vocab_size=QWEN_VOCAB, tie_word_embeddings=True,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config, processor = onevision_parts(tokenizer, text, **ONEVISION_VISION)
    config.tie_word_embeddings = True
    model = _init(LlavaOnevisionForConditionalGeneration, config, seed, dtype, device)
    return _finish(model, processor, folder)


def random_adapter(shape: str, *, device: str | torch.device, dtype: torch.dtype, seed: int = 0):
    """A benchmark shape (SHAPES) with random weights, made in memory on `device` (no folder: a 7B model's
    weights would take minutes to write and read), behind the adapter of its family."""
    from ..engine.models.adapters import adapter_for

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {tuple(SHAPES)}")
    family, size = SHAPES[shape]
    kwargs = dict(seed=seed, dtype=dtype, device=device)
    if family == "default":
        model, processor = build_default_shape(None, **kwargs)
    elif family == "llama":
        model, processor = build_llama(None, size=size, **kwargs)
    else:
        model, processor = build_llava(None, size=size, onevision=True, **kwargs) if family == "llava_onevision" \
            else build_qwen2_vl(None, size=size, **kwargs)
    cls = adapter_for(model.config)
    if cls.supports_frames:
        return cls(model, processor.tokenizer, folder=f"random:{shape}", processor=processor)
    return cls(model, processor, folder=f"random:{shape}")


def build_model_folder(family: str, folder: str | Path, *, size: str = "tiny", seed: int = 0,
                       dtype: torch.dtype = torch.float32) -> Path:
    """Build and save a random-weight model of `family` into `folder`; returns the folder."""
    folder = Path(folder)
    if family in ("qwen2_vl", "qwen2_5_vl"):
        return build_qwen2_vl(folder, size=size, seed=seed, v2_5=family == "qwen2_5_vl", dtype=dtype)
    if family in ("llava", "llava_onevision"):
        return build_llava(folder, size=size, seed=seed, onevision=family == "llava_onevision", dtype=dtype)
    if family == "idefics3":
        return build_idefics3(folder, size=size, seed=seed, dtype=dtype)
    if family == "llama":
        return build_llama(folder, size=size, seed=seed, dtype=dtype)
    raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES + TEXT_FAMILIES}")
