"""What the streaming engine needs from a model family, behind one small interface.

An adapter owns a loaded transformers model and its tokenizer (or processor) and answers: how to embed
tokens, which positions a prompt gets, how to run the decoder over embeddings with our cache, and (for
vision-language families) how to turn a camera frame into embeddings. Everything else, chunking,
eviction and generation, is the engine's and is the same for every family.
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from ..attention import ATTENTION_NAME
from ..cache import PromptPositions
from ..chat import ChatFormat


class FramesNotSupportedError(ValueError):
    """A camera frame was pushed to a model that has no vision tower."""


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
        self.chat = ChatFormat.from_tokenizer(tokenizer)
        self.model.set_attn_implementation(ATTENTION_NAME)
        self.attention_modules = frozenset(
            m for m in self.decoder.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")
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
        """The module that takes inputs_embeds, position_ids and past_key_values."""
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
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        return ids.to(self.device)

    def text_prompt(self, token_ids: Tensor) -> Prompt:
        token_ids = token_ids.to(self.device)
        embeds = self.model.get_input_embeddings()(token_ids)
        q = token_ids.shape[0]
        positions = torch.arange(q, device=self.device)
        return Prompt(embeds, self.text_position_ids(positions), positions + 1, token_ids)

    def text_position_ids(self, positions: Tensor) -> Tensor:
        """Model position ids of text tokens at the given 1-D positions."""
        return positions

    def frame_prompt(self, rgb: np.ndarray, stamp: float | None, *, max_pixels: int | None = None) -> Prompt:
        raise FramesNotSupportedError(
            f"{self.family} model {self.folder or type(self.model).__name__} is text only: it cannot take camera frames"
        )

    # --- decoding ------------------------------------------------------------------------------------
    def model_position_ids(self, prompt_position_ids: Tensor, offset: int) -> Tensor:
        """Batch the prompt's position ids and shift them to the running offset."""
        return (prompt_position_ids + offset).unsqueeze(-2)

    def forward(self, embeds: Tensor, position_ids: Tensor, cache, *, all_logits: bool = False) -> Tensor:
        """Run the decoder over [q, hidden] embeddings; returns float32 logits [q or 1, vocab]."""
        out = self.decoder(
            inputs_embeds=embeds.unsqueeze(0), position_ids=position_ids, past_key_values=cache, use_cache=True
        )
        hidden = out.last_hidden_state[0]
        if not all_logits:
            hidden = hidden[-1:]
        return self.model.lm_head(hidden).float()

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def describe(self) -> dict:
        return {"family": self.family, "folder": self.folder, "layers": self.num_layers, "dtype": str(self.dtype)}


class CausalLMAdapter(ModelAdapter):
    """Plain decoder-only language models (Llama, Qwen2, Mistral, SmolLM2...): text only."""

    family = "causal_lm"
    model_types = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3", "olmo", "granite")
