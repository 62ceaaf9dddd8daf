"""What the streaming engine needs from a model family, behind one small interface.

An adapter owns a loaded transformers model and its tokenizer (or processor) and answers: how to embed
tokens, which positions a prompt gets, how to run the decoder over embeddings with our cache, and (for
vision-language families) how to turn a camera frame into embeddings. Everything else, chunking,
eviction and generation, is the engine's and is the same for every family.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import math
import numbers
import types
from abc import ABC
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from ...ops.attention import ATTENTION_NAME
from ...ops.few_rows import prepare_linears
from ..chat import STREAM_CLOCK, ChatFormat, MarkerClock, check_stamp, stamped
from ...model_errors import FramesNotSupportedError


@dataclass
class Prompt:
    """One prompt ready for the decoder: embeddings plus the positions of each token.

    position_ids is what the model's rotary embedding takes for these tokens, relative to the first
    position of the prompt (the engine adds the running offset). positions holds the same per token
    as (start, end) for the cache's bookkeeping.
    """

    embeds: Tensor  # [q, hidden]
    position_ids: Tensor  # [q] for 1-D RoPE, [3, q] for M-RoPE, counted from 0
    extent: Tensor  # [q] one past the largest position component of each token, counted from 0
    token_ids: Tensor | None = None  # [q] when the prompt is text only

    def __len__(self) -> int:
        return int(self.embeds.shape[0])

    def slice(self, start: int, stop: int) -> "Prompt":
        ids = None if self.token_ids is None else self.token_ids[start:stop]
        return Prompt(self.embeds[start:stop], self.position_ids[..., start:stop], self.extent[start:stop], ids)


class ModelAdapter(ABC):
    """Base adapter: a decoder-only language model with 1-D RoPE. Families override the parts that differ."""

    family: ClassVar[str] = "causal_lm"
    # config.model_type values this adapter serves
    model_types: ClassVar[tuple[str, ...]] = ()
    supports_frames: ClassVar[bool] = False

    def __init__(self, model: nn.Module, tokenizer, *, folder: str = "", processor=None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.processor = processor
        self.folder = folder
        # A caveat to show users with this model: what the embedded default's folder says (embedded_models.py).
        self.notice = str(getattr(getattr(model, "config", None), "inf_mllm_notice", "") or "")
        self.chat = ChatFormat.from_tokenizer(tokenizer)
        self.model.set_attn_implementation(ATTENTION_NAME)
        prepare_linears(self.model)  # a batch's few rows as fast as one: engine/ops/few_rows.py
        # transformers 5.24 renamed the decoder's past_key_values to cache, and drops the old name in 5.40.
        self._cache_argument = (
            "cache" if "cache" in inspect.signature(self.decoder.forward).parameters else "past_key_values"
        )

    # --- loading -----------------------------------------------------------------------------------
    @classmethod
    def load(cls, folder: str, config, *, device: torch.device, dtype: torch.dtype, trust_remote_code: bool):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa"
        ).to(device)
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
        return cls(model, tokenizer, folder=folder)

    # --- structure ---------------------------------------------------------------------------------
    @property
    def decoder(self) -> nn.Module:
        """The module that takes inputs_embeds, position_ids and the cache."""
        return self.model.model

    @property
    def text_config(self):
        return self.model.config.get_text_config()

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def max_context(self) -> int:
        return int(getattr(self.text_config, "max_position_embeddings", 0) or 0)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    def rope_inv_freq(self) -> Tensor:
        for module in self.decoder.modules():
            inv_freq = getattr(module, "inv_freq", None)
            if isinstance(inv_freq, Tensor):
                return inv_freq.detach().float()
        raise ValueError(f"{type(self.model).__name__} has no rotary embedding: positions cannot be re-packed")

    @property
    def stop_token_ids(self) -> set[int]:
        ids = set()
        for source in (getattr(self.model, "generation_config", None), self.text_config, self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        suffix = self.chat.assistant_suffix.strip()
        if suffix:
            token = self.tokenizer.convert_tokens_to_ids(suffix)
            if isinstance(token, int) and token != getattr(self.tokenizer, "unk_token_id", None):
                ids.add(token)
        return ids

    # --- prompts -------------------------------------------------------------------------------------
    def tokenize(self, text: str) -> Tensor:
        """Template text: strings of special tokens in it become their control tokens."""
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        return ids.to(self.device)

    def tokenize_plain(self, text: str) -> Tensor:
        """User text: strings of special tokens in it ("<|im_end|>", "[INST]", "<image>"...) stay characters."""
        ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True,
                             return_tensors="pt")["input_ids"][0]
        return ids.to(self.device)

    @functools.cached_property
    def control_token_ids(self) -> frozenset[int]:
        """Ids of the tokenizer's special tokens: turn markers, BOS/EOS, image placeholders..."""
        ids = set(getattr(self.tokenizer, "all_special_ids", None) or ())
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        ids.update(i for i, token in added.items() if getattr(token, "special", False))
        return frozenset(ids)

    def tokenize_turn(self, parts: tuple[str, str, str]) -> Tensor:
        """Token ids of one chat turn, (template before, content, template after) as ChatFormat gives it.

        The template keeps its control tokens; the content is tokenized as the characters it is, so that a
        message or a question that spells a control token cannot end its turn, open a system turn or place
        an image. Content that spells none gets exactly the ids of the whole turn tokenized at once.
        """
        prefix, content, suffix = parts
        try:
            encoding = self.tokenizer(prefix + content + suffix, add_special_tokens=False,
                                      return_offsets_mapping=True)
        except NotImplementedError:  # a Python tokenizer without offsets: always take the careful way
            encoding = None
        if encoding is not None:
            low, high = len(prefix), len(prefix) + len(content)
            control = self.control_token_ids
            spans = zip(encoding["input_ids"], encoding["offset_mapping"])
            if not any(i in control and start < high and end > low for i, (start, end) in spans):
                return torch.tensor(encoding["input_ids"], dtype=torch.long, device=self.device)
        # The content spells a control token (or reaches into one of the template's): each piece on its own.
        pieces = [self.tokenize(prefix), self.tokenize_plain(content), self.tokenize(suffix)]
        return torch.cat([piece.to(torch.long) for piece in pieces])

    def text_prompt(self, token_ids: Tensor) -> Prompt:
        token_ids = token_ids.to(self.device)
        embeds = self.model.get_input_embeddings()(token_ids)
        q = token_ids.shape[0]
        positions = torch.arange(q, device=self.device)
        return Prompt(embeds, self.text_position_ids(positions), positions + 1, token_ids)

    def text_position_ids(self, positions: Tensor) -> Tensor:
        """Model position ids of text tokens at the given 1-D positions."""
        return positions

    def frame_prompt(self, rgb: np.ndarray, stamp: float | None, *, max_pixels: int | None = None,
                     clock: MarkerClock = STREAM_CLOCK, camera: str = "") -> Prompt:
        """A frame as a user turn, its marker naming `camera` where it has a name ("" for a single camera)."""
        raise FramesNotSupportedError(
            f"{self.family} model {self.folder or type(self.model).__name__} is text only: it cannot take camera frames"
        )

    # --- decoding ------------------------------------------------------------------------------------
    def model_position_ids(self, prompt_position_ids: Tensor, offset: int) -> Tensor:
        """Batch the prompt's position ids and shift them to the running offset."""
        return (prompt_position_ids + offset).unsqueeze(-2)

    def forward(self, embeds: Tensor, position_ids: Tensor, cache, *, all_logits: bool = False,
                attention_mask: Tensor | None = None, logits_at: Tensor | None = None, logits: bool = True,
                **attention_kwargs) -> Tensor | None:
        """Run the decoder over [q, hidden] embeddings; returns float32 logits [q or 1, vocab].

        attention_mask: a 4-D mask, taken as given (None: causal over the cache's slots and the new tokens).
        logits_at: the index ([1] tensor) of the one token whose logits are returned, in place of the last (a
        padded block's last real token, on fixed shapes). logits=False: none made, None returned (a pass for what
        it leaves in the cache or captures).
        attention_kwargs reach the attention function (the engine's `bounded_cache`, engine/ops/attention.py)."""
        out = self.decoder(
            inputs_embeds=embeds.unsqueeze(0), position_ids=position_ids, attention_mask=attention_mask,
            use_cache=True, **{self._cache_argument: cache}, **attention_kwargs,
        )
        if not logits:
            return None
        hidden = out.last_hidden_state[0]
        if logits_at is not None:
            hidden = hidden.index_select(0, logits_at)
        elif not all_logits:
            hidden = hidden[-1:]
        return self.model.lm_head(hidden).float()

    def forward_batch(self, embeds: Tensor, position_ids: Tensor, cache, attention_mask: Tensor, *,
                      logits_at: Tensor | None = None, logits: bool = True, **attention_kwargs) -> Tensor | None:
        """Several sequences through the decoder in one pass, each over its own rows of `cache`: embeds [batch, q,
        hidden], a 4-D mask per sequence, taken as given; returns each one's last token's float32 logits
        [batch, vocab] (the batched answers of engine/memory/batched_step.py), or with `logits_at` ([batch]) those
        of each one's token there (padded blocks: engine/memory/batched_ingest.py); logits=False: None."""
        out = self.decoder(inputs_embeds=embeds, position_ids=position_ids, attention_mask=attention_mask,
                           use_cache=True, **{self._cache_argument: cache}, **attention_kwargs)
        if not logits:
            return None
        hidden = out.last_hidden_state
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        hidden = hidden[:, -1] if logits_at is None else hidden[rows, logits_at]
        return self.model.lm_head(hidden).float()

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def describe(self) -> dict:
        info = {"family": self.family, "folder": self.folder, "layers": self.num_layers, "dtype": str(self.dtype),
                "frames": self.supports_frames}
        if self.notice:
            info["notice"] = self.notice
        return info


class CausalLMAdapter(ModelAdapter):
    """Plain decoder-only language models (Llama, Qwen2, Mistral, SmolLM2...): text only."""

    family = "causal_lm"
    model_types = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3", "olmo", "granite")


# --- frames ------------------------------------------------------------------------------------------

def validate_frame(rgb, stamp: float | None = None) -> np.ndarray:
    """Check a camera frame before anything else sees it: an H x W x 3 uint8 RGB array, H, W >= 1."""
    if not isinstance(rgb, np.ndarray):
        raise ValueError(f"frame must be a numpy array (H x W x 3, uint8 RGB), got {type(rgb).__name__}")
    if rgb.dtype != np.uint8:
        raise ValueError(f"frame must have dtype uint8 (RGB 0..255), got {rgb.dtype}")
    if rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"frame must have shape H x W x 3 (RGB), got {rgb.shape}")
    if rgb.shape[0] < 1 or rgb.shape[1] < 1:
        raise ValueError(f"frame is empty: shape {rgb.shape}")
    check_stamp(stamp, "frame")
    return np.ascontiguousarray(rgb)


def fit_pixels(rgb: np.ndarray, max_pixels: int | None) -> np.ndarray:
    """Scale a frame down (aspect kept) so that it has at most max_pixels pixels; never scales up."""
    if max_pixels is None:
        return rgb
    if not isinstance(max_pixels, numbers.Integral) or max_pixels < 1:
        raise ValueError(f"max_frame_pixels must be a positive integer or None, got {max_pixels!r}")
    height, width = rgb.shape[:2]
    if height * width <= max_pixels:
        return rgb
    from PIL import Image

    scale = math.sqrt(int(max_pixels) / (height * width))
    size = (max(1, int(width * scale)), max(1, int(height * scale)))
    return np.asarray(Image.fromarray(rgb).resize(size, Image.BILINEAR))


def image_only_processor_class(cls):
    """A processor class without its video part, for installs without torchvision (which video
    processors need). Saved and loaded under the family's own class name."""

    class ImageOnly(cls):
        # transformers builds, saves and loads a processor's parts from this list; the family's own
        # __init__ takes video_processor=None and hands its parts to ProcessorMixin positionally.
        @classmethod
        def get_attributes(cls_):
            return [name for name in super().get_attributes() if name != "video_processor"]

    init = cls.__init__
    positional = [p for p in inspect.signature(init).parameters.values() if p.default is p.empty
                  and p.kind is p.POSITIONAL_OR_KEYWORD]
    if positional[-1].name == "video_processor":  # required (SmolVLM): the same __init__, defaulting it to None
        ImageOnly.__init__ = types.FunctionType(init.__code__, init.__globals__, init.__name__,
                                                (None,) + (init.__defaults__ or ()), init.__closure__)
        ImageOnly.__init__.__kwdefaults__ = init.__kwdefaults__
    ImageOnly.__name__ = ImageOnly.__qualname__ = cls.__name__
    return ImageOnly


def load_processor(folder: str, *, trust_remote_code: bool = False):
    """The model folder's own processor; without torchvision, its image part only."""
    import transformers
    from transformers import AutoProcessor

    name = None
    config = Path(folder) / "processor_config.json"
    if config.exists():
        name = json.loads(config.read_text()).get("processor_class")
    cls = getattr(transformers, name, None) if name else None
    takes_video = cls is not None and "video_processor" in inspect.signature(cls.__init__).parameters
    if not takes_video or importlib.util.find_spec("torchvision") is not None:
        try:
            return AutoProcessor.from_pretrained(folder, trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            if not takes_video:  # a folder without a video processor config, loaded below
                raise
    return image_only_processor_class(cls).from_pretrained(folder)


class VisionLanguageAdapter(ModelAdapter):
    """What the vision-language families share: a frame becomes one user turn with a time marker,
    its pixels are prepared by the model's own processor, encoded by its own vision tower and projector,
    and the image features replace the image placeholder tokens. Families set the placeholder and
    override the parts that differ (positions, resolution bound)."""

    supports_frames = True
    image_placeholder: ClassVar[str] = "<image>"  # what the processor expands into the image's tokens
    _text_inputs = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")

    def __init__(self, model: nn.Module, tokenizer, *, folder: str = "", processor=None):
        template = getattr(processor, "chat_template", None)
        if template and not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = template  # vision-language folders often keep it on the processor only
        super().__init__(model, tokenizer, folder=folder, processor=processor)

    @classmethod
    def load(cls, folder: str, config, *, device: torch.device, dtype: torch.dtype, trust_remote_code: bool):
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(
            folder, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa"
        ).to(device)
        processor = load_processor(folder, trust_remote_code=trust_remote_code)
        return cls(model, processor.tokenizer, folder=folder, processor=processor)

    @property
    def decoder(self) -> nn.Module:
        inner = self.model.model
        return inner.language_model if hasattr(inner, "language_model") else inner.text_model

    @property
    def image_token_id(self) -> int:
        return int(self.model.config.image_token_id)

    # --- frames --------------------------------------------------------------------------------------
    def frame_text(self, stamp: float | None, clock: MarkerClock = STREAM_CLOCK, camera: str = "") -> str:
        return self.chat.user(stamped(self.image_placeholder, stamp, clock, camera))

    def processor_kwargs(self, height: int, width: int, max_pixels: int | None) -> dict:
        """Extra processor arguments that keep the frame within max_pixels (the image is already scaled)."""
        return {}

    def frame_inputs(self, rgb: np.ndarray, stamp: float | None, *, max_pixels: int | None = None,
                     clock: MarkerClock = STREAM_CLOCK, camera: str = ""):
        """The processor's output for one frame turn: input_ids with the image tokens, pixel values..."""
        rgb = fit_pixels(validate_frame(rgb, stamp), max_pixels)
        kwargs = self.processor_kwargs(rgb.shape[0], rgb.shape[1], max_pixels)
        # Say H x W x C: a frame 1 or 3 pixels high would otherwise pass for channels-first.
        kwargs.setdefault("images_kwargs", {})["input_data_format"] = "channels_last"
        return self.processor(text=[self.frame_text(stamp, clock, camera)], images=[rgb], return_tensors="pt",
                              add_special_tokens=False, **kwargs)

    def frame_prompt(self, rgb: np.ndarray, stamp: float | None, *, max_pixels: int | None = None,
                     clock: MarkerClock = STREAM_CLOCK, camera: str = "") -> Prompt:
        inputs = self.frame_inputs(rgb, stamp, max_pixels=max_pixels, clock=clock, camera=camera)
        ids = inputs["input_ids"][0].to(self.device)
        with torch.inference_mode():
            embeds = self.model.get_input_embeddings()(ids)
            features = self.image_features(inputs)
            mask = ids == self.image_token_id
            if int(mask.sum()) != features.shape[0]:
                raise RuntimeError(f"{int(mask.sum())} image tokens but {features.shape[0]} image features")
            embeds = embeds.masked_scatter(mask[:, None], features.to(embeds.dtype))
            position_ids, extent = self.frame_positions(ids, inputs)
        return Prompt(embeds, position_ids, extent, None)

    def image_features(self, inputs) -> Tensor:
        """[image tokens, hidden]: the vision tower and projector over the processor's image inputs."""
        kwargs = {}
        for name, value in inputs.items():
            if name in self._text_inputs:
                continue
            if isinstance(value, Tensor):
                value = value.to(self.device, self.dtype if value.is_floating_point() else value.dtype)
            kwargs[name] = value
        features = self.model.get_image_features(**kwargs, return_dict=True).pooler_output
        if isinstance(features, (list, tuple)):
            return torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
        return features.reshape(-1, features.shape[-1])

    def frame_positions(self, ids: Tensor, inputs) -> tuple[Tensor, Tensor]:
        """(position_ids, extent) of a frame turn counted from 0; 1-D positions unless overridden."""
        positions = torch.arange(ids.shape[0], device=ids.device)
        return self.text_position_ids(positions), positions + 1
