"""The layer-heads whose queries find a fact again: the archive's scoring heads, found once per model.

Summed over every head, a question about one of several facts of the same form ("the access code of the
blue cabinet", "... of the yellow cabinet") scores all of them alike: most heads are drawn to what the
facts share, or to whatever is generic (early text, turn templates). A few heads ("retrieval heads")
attend to the one fact the question names. They are the model's, not the stream's, so they are found by
the model itself on a synthetic stream: machine serial numbers (a form used by neither data set the
archive's defaults were chosen or reported on) between generated log lines, the subjects named again
now and then; each is asked about, every layer-head scores the archived blocks as retrieval does, and
the heads that rank the asked fact's block highest are kept (a tenth of them, at least MIN_HEADS).
About 1,500 tokens through the model, once per model (a few seconds to a minute on a CPU, by the model): the heads
are kept in a small file named by the model's fingerprint (`$INF_MLLM_CACHE_DIR`, default
~/.cache/inf_mllm_ros), so that a restarted node does not find them again.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor

from .retrieval_index import REFERENCE_WEIGHT
from ..persistence.memory_file import model_fingerprint

if TYPE_CHECKING:
    from ..models.adapters import ModelAdapter

# The share of layer-heads that score, and the fewest. On the tuning set (docs/archive.md) a tenth ranked
# the asked fact's block first more often than a twentieth or a fifth.
SHARE = 0.1
MIN_HEADS = 8
FACTS = 16
ADJECTIVES = ["north", "south", "east", "west", "old", "new", "upper", "lower"]
MACHINES = ["pump", "crane", "drone", "conveyor", "generator", "scanner", "press", "boiler"]
ACTORS = ["The day crew", "A robot", "The supervisor", "A driver", "The night crew", "An inspector"]
ACTIONS = ["moved a crate to", "swept the floor near", "counted the boxes in", "checked the lights of",
           "parked a cart beside", "labelled the shelves of"]
PLACES = ["bay 4", "the east dock", "aisle 9", "the loading ramp", "the stores", "hall B", "the yard"]
# Part of the file name of found heads: raised whenever the way they are found changes.
METHOD_VERSION = 1

_found: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()

# A fresh stream of the model with the given StreamConfig settings (a KVStream's), for the synthetic stream.
StreamFactory = Callable[..., Any]


def retrieval_heads(adapter: ModelAdapter, new_stream: StreamFactory,
                    find: Callable[[ModelAdapter, StreamFactory], Tensor] | None = None) -> Tensor | None:
    """[layers, query heads] bool: the heads the archive scores with for this model (found on first use, on a
    stream `new_stream` makes, by `find`: `kept_or_found` unless given). None where they could not be found: every
    head of the middle half of the layers then scores."""
    with _lock:
        if adapter not in _found:
            try:
                _found[adapter] = (find or kept_or_found)(adapter, new_stream)
            except (RuntimeError, ValueError) as exc:  # a model the synthetic stream does not suit
                logging.getLogger(__name__).warning("retrieval heads not found (%s); scoring on every head of the "
                                                    "middle half of the layers", exc)
                _found[adapter] = None
        return _found[adapter]


def cache_dir() -> Path:
    return Path(os.environ.get("INF_MLLM_CACHE_DIR") or Path.home() / ".cache" / "inf_mllm_ros")


def kept_or_found(adapter: ModelAdapter, new_stream: StreamFactory) -> Tensor:
    """The heads from their file where a run before found them for this model; else found and kept (a
    file that cannot be read or written only costs finding them again)."""
    path = cache_dir() / f"retrieval_heads-v{METHOD_VERSION}-{model_fingerprint(adapter)[:32]}.json"
    try:
        kept = json.loads(path.read_text())
        heads = torch.zeros(kept["layers"], kept["query_heads"], dtype=torch.bool)
        heads[tuple(torch.tensor(kept["heads"], dtype=torch.long).T)] = True
        return heads
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        pass
    heads = find_retrieval_heads(adapter, new_stream)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
            json.dump({"layers": heads.shape[0], "query_heads": heads.shape[1],
                       "heads": heads.nonzero().tolist()}, tmp)
        os.replace(tmp.name, path)
    except OSError:
        if tmp is not None:  # no half-written file left behind
            Path(tmp.name).unlink(missing_ok=True)
    return heads


def find_retrieval_heads(adapter: ModelAdapter, new_stream: StreamFactory, seed: int = 0) -> Tensor:
    """Run the synthetic stream (made by `new_stream`) and keep the layer-heads that rank each asked fact's block
    highest."""
    rng = random.Random(seed)
    subjects = rng.sample([f"the {a} {m}" for a in ADJECTIVES for m in MACHINES], FACTS)
    stream = new_stream(capacity=256, archive_size=8192, retrieve_tokens=0)

    def log_line() -> str:
        return f"{rng.choice(ACTORS)} {rng.choice(ACTIONS)} {rng.choice(PLACES)}."

    told = []
    for subject in subjects:
        for _ in range(rng.randint(1, 2)):
            stream.push_text(log_line())
        first = stream.tokens_seen
        value = f"{rng.choice('KMRTX')}{rng.choice('ABCDE')}{rng.randint(1000, 9999)}"
        stream.push_text(f"The serial number of {subject} is {value}.")
        told.append((subject, first, stream.tokens_seen))
    for k in range(24):
        stream.push_text(f"Someone serviced {subjects[k % FACTS]}." if k % 3 == 2 else log_line())

    archive, blocks = stream.archive, list(stream.archive.blocks)
    reference_queries = stream.content_queries(*stream.retriever.reference_question)
    layers, q_heads = reference_queries[0].shape[:2]
    archive.build_index(torch.ones(layers, q_heads, dtype=torch.bool), reference_queries, "cpu")
    above = torch.zeros(layers * q_heads)
    for subject, first, end in told:
        ids, content = stream.question_ids(adapter.chat.question_parts(f"What is the serial number of {subject}?"))
        question, reference = archive.index.head_scores(*stream.content_queries(ids, content), blocks)
        scores = (question - REFERENCE_WEIGHT * reference).cpu()
        own = [i for i, b in enumerate(blocks) if b.first_seq < end and b.seq_end > first]
        above += (scores > scores[:, own].amax(1, keepdim=True)).sum(1)
    keep = max(MIN_HEADS, round(SHARE * layers * q_heads))
    heads = torch.zeros(layers * q_heads, dtype=torch.bool)
    heads[torch.argsort(above, stable=True)[:keep]] = True
    return heads.view(layers, q_heads)
