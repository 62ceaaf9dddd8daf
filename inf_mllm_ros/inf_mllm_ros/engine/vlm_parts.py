"""The config and processor of a SmolVLM/Idefics3-shaped model around a given tokenizer and language
config: the shape of the embedded default model (loading.py), whose language weights are real, and of
the random test models (random_models.py)."""

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
