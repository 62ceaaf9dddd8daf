"""Configs and processors of vision-language shapes around a given tokenizer and language config:
SmolVLM/Idefics3 (the small embedded model) and LLaVA-OneVision (the embedded default), whose language
weights are real (loading.py), and the random test models of the same families (testing/random_models.py)."""

from __future__ import annotations

IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]


def idefics3_parts(tokenizer, text_config: dict, *, image_size: int, patch_size: int, scale_factor: int,
                   vision_width: int, vision_layers: int, tiles_per_side: int = 2):
    """The Idefics3/SmolVLM config and processor around a given tokenizer and language config."""
    from transformers import Idefics3Config, Idefics3ImageProcessorPil, Idefics3Processor

    missing = [t for t in IDEFICS3_TOKENS if t not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    config = Idefics3Config(
        text_config=text_config,
        vision_config=dict(hidden_size=vision_width, intermediate_size=vision_width * 4,
                           num_hidden_layers=vision_layers, num_attention_heads=max(1, vision_width // 64),
                           image_size=image_size, patch_size=patch_size),
        scale_factor=scale_factor,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    config.text_config.vocab_size = max(config.text_config.vocab_size, len(tokenizer))
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": image_size * tiles_per_side}, max_image_size={"longest_edge": image_size})
    seq_len = (image_size // patch_size) ** 2 // scale_factor**2
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=seq_len,
                                  chat_template=tokenizer.chat_template)
    return config, processor


def onevision_parts(tokenizer, text_config: dict, *, image_size: int, patch_size: int, vision_width: int,
                    vision_layers: int, max_tiles_per_side: int = 1, image_token: str = "<image>",
                    video_token: str = "<video>"):
    """The LLaVA-OneVision config and processor around a given tokenizer and (Qwen2) language config:
    a SigLIP-style tower, every patch kept ("full"), a base view plus any-resolution tiles of the
    same size, and a newline embedding after each row of tile patches."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionImageProcessorPil, LlavaOnevisionProcessor

    from .adapters.base import image_only_processor_class

    missing = [t for t in (image_token, video_token) if t not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    sides = range(1, max_tiles_per_side + 1)
    pinpoints = [[image_size * r, image_size * c] for r in sides for c in sides]
    config = LlavaOnevisionConfig(
        text_config=dict(text_config, model_type="qwen2"),
        vision_config=dict(model_type="siglip_vision_model", vision_use_head=False, hidden_size=vision_width,
                           intermediate_size=vision_width * 4, num_hidden_layers=vision_layers,
                           num_attention_heads=max(1, vision_width // 64), image_size=image_size,
                           patch_size=patch_size),
        image_token_index=tokenizer.convert_tokens_to_ids(image_token),
        video_token_index=tokenizer.convert_tokens_to_ids(video_token),
        image_grid_pinpoints=pinpoints, vision_feature_select_strategy="full", vision_feature_layer=-1,
    )
    config.text_config.vocab_size = max(config.text_config.vocab_size, len(tokenizer))
    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": image_size, "width": image_size}, image_grid_pinpoints=pinpoints)
    processor = image_only_processor_class(LlavaOnevisionProcessor)(
        image_processor=image_processor, tokenizer=tokenizer, num_image_tokens=(image_size // patch_size) ** 2,
        vision_feature_select_strategy="full", chat_template=tokenizer.chat_template, image_token=image_token,
        video_token=video_token)
    return config, processor
