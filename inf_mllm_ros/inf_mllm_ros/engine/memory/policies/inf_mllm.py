"""Inf-MLLM: attention sinks, a recent window, and the attention saddles between, with a recency bias,
a share of the slots for text and one for pinned messages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ...ops.scoring import visible_counts
from .base import (
    EvictionPolicy,
    SlotView,
    _check_recent,
    _keep_ends_and_best,
    _recent,
    register,
)
from ...policy_knobs import takes_knobs


@register
@dataclass
@takes_knobs
class InfMLLMPolicy(EvictionPolicy):
    """Inf-MLLM: attention sinks, a recent window, and the attention saddles between, with a recency bias.

    Kept always: the first `sink_size` tokens of the stream, and the newest `recent_size` tokens, at
    least twice the block just pushed (so the block before it too, unless that one was longer). A block's
    own queries cannot judge it fairly (its last key would be judged by one query, its own), and the next
    block's queries sit right after it, where local attention favours its last tokens; so a block is first
    judged by the block after next.
    The tokens between are the candidates. At each eviction the candidates' attention from the retrieval
    window (the queries pushed since the last eviction) is averaged per query: every candidate is older
    than the window, so every window query sees it. With `score_memory`, a candidate's attention A is the
    decayed sum of what the windows since it arrived paid it:

        A <- memory_decay * A + a

    Saddles are the tokens that keep drawing attention: attention that comes prompt after prompt adds up
    (a token drawing the same attention at every eviction counts 1 / (1 - memory_decay) times a
    newcomer's: ten times at 0.9), and fades by that factor per eviction (one per block of up to
    chunk_size tokens) once it stops (why not each token's peak as well: docs/method.md). The score ranks
    candidates by log attention against log age, and a kept token keeps its neighbours (each candidate
    scores as the best within `score_pool` slots centred on it):

        score = log A - attention_bias * log(age)      (age: tokens pushed since the candidate's block)

    that is A / age^attention_bias: a token twice as old keeps its slot against a younger one only if it
    has drawn 2^attention_bias times more attention (10 times as old: 10^attention_bias). Both terms are
    ratios, so the bias means the same at any cache size, head count, pooling or stream length, and the
    cache keeps moving however long the stream runs: a saddle stays until its age outgrows its attention.
    A bias of 0 lets early winners hold the cache for good; a very large bias turns the candidates into a
    window. Age counts from the end of the block a token came in (`born`, stamped at the first eviction
    that sees it), so the tokens of one block are equally old: the bias prefers newer blocks, never the
    second half of a block.
    A camera frame brings a hundred tokens or more that draw attention from one another; the text a
    robot is told is sparse. So `text_share` of the candidate slots go to the text tokens that have drawn
    the most attention, their age aside, whenever there is that much text, and the rest to the best of
    everything. The bias is what keeps frames from holding the cache; inside the text's share it would
    only put each newer mention of a subject ahead of the older fact it refers to.
    Attention keeps only what something has referred to: a fact a robot is told and not asked about for
    an hour draws none. So a caller may pin a message (`KVStream.push_text(..., pin=True)`): its tokens
    rank above every other candidate, the newest pins first, in up to `pin_share` of the slots beside the
    sinks (those the recent window holds count in it); pins beyond that compete on score like any token.
    `score_memory=False, score_pool=1, text_share=0` with nothing pinned is the plain method (the newest
    window's attention alone, one ranking for all).
    """

    name: ClassVar[str] = "inf_mllm"
    needs_attention: ClassVar[bool] = True
    slot_stats: ClassVar[tuple[str, ...]] = ("attention_sum", "born")
    def check_capacity(self, capacity: int) -> None:
        _check_recent(self.recent_size, capacity)

    def protected(self, capacity: int) -> tuple[int, int]:
        sinks = min(self.sink_size, capacity)
        return sinks, min(_recent(self.recent_size, capacity), capacity - sinks)

    def regions(self, view: SlotView, keep: int) -> tuple[int, int]:
        """(sinks, recent) at this eviction: the protected slots, and at least twice the block just pushed in
        the recent window (the block before it too, unless that one was longer): the queries right after a
        block are the ones whose local attention favours its last tokens, so a block is first judged by the
        block after next. (The size of the block before is not known here, only the one just pushed.)"""
        sinks, recent = self.protected(keep)
        return sinks, min(max(recent, 2 * view.new), keep - sinks)

    def drawn(self, view: SlotView, sinks: int, recent: int) -> Tensor:
        """Log of the attention the candidates (slots sinks .. fill - recent) have drawn, pooled; updates
        their memory and stamps the window's own tokens with their block's end."""
        if view.new:
            view.stats["born"][:, view.fill - view.new :] = float(view.stream_end)
        end = view.fill - recent
        cand = slice(sinks, end)
        attention = view.window_attention[:, cand]
        if end <= view.fill - view.new:
            # Every candidate is older than the window: each window query saw it.
            attention = attention / max(view.window_queries, 1)
        else:
            # Candidates among the window's own tokens (at the first eviction, or when pins take the recent
            # window's room) are seen by the window's queries from their own on.
            attention = attention / visible_counts(view.fill - view.new, view.new, attention.device)[cand]
        if self.score_memory:
            # Attention that keeps coming adds up; once it stops it fades by memory_decay per eviction.
            total = view.stats["attention_sum"][:, cand]
            if view.window_queries:  # a window that judged nothing (after a restore) ages nothing
                total.mul_(self.memory_decay).add_(attention)
            attention = total
        drawn = torch.log(attention.clamp(min=1e-30))
        if self.score_pool > 1 and drawn.shape[-1] > 1:
            # A token that draws attention is usually part of a phrase: keep its neighbours with it.
            drawn = F.max_pool1d(drawn[:, None], self.score_pool, stride=1, padding=self.score_pool // 2)[:, 0]
        return drawn

    def aged(self, view: SlotView, drawn: Tensor, sinks: int) -> Tensor:
        """The candidates' scores from what they have drawn (`drawn`, from slot `sinks` on): less the bias
        times the log of their age."""
        if self.attention_bias == 0.0 or drawn.shape[-1] == 0:
            return drawn
        # Tokens pushed since the candidate's block ended: the queries that will judge the cache next.
        born = view.stats["born"][:, sinks : sinks + drawn.shape[-1]]
        age = (float(view.stream_end) - born).clamp_(min=1.0)
        return drawn - self.attention_bias * torch.log_(age)

    def select(self, view: SlotView, keep: int) -> Tensor:
        """The sinks, the recent window (less the room the pins need), and the candidates between by their
        score, with the text's and the pins' quotas ranked above the rest."""
        sinks, recent = self.regions(view, keep)
        recent, pin_room = self._room_for_pins(view, keep, sinks, recent)
        drawn, score = self._score(view, sinks, recent)
        score = self._apply_text_and_pin_quotas(view, keep, sinks, recent, drawn, score, pin_room)
        return _keep_ends_and_best(view, keep, sinks, recent, score)

    def _room_for_pins(self, view: SlotView, keep: int, sinks: int, recent: int) -> tuple[int, int | None]:
        """(recent, pin_room): the recent window, shortened where the pins need its room, and the pins'
        budget; None when no pin counts (pin_share 0, or nothing pinned beside the sinks)."""
        pinned = view.pinned if self.pin_share > 0.0 and view.pinned is not None else None
        if pinned is None or not bool(pinned[:, sinks:].any()):
            return recent, None
        # The pins' budget is a share of every slot but the sinks, and they outrank the oldest of the
        # recent window when it would leave them no room (at the first eviction the whole stream is new).
        pin_room = int(self.pin_share * (keep - sinks))
        recent = min(recent, keep - sinks - min(int(pinned[:, sinks:].sum(-1).max()), pin_room))
        return recent, pin_room

    def _score(self, view: SlotView, sinks: int, recent: int) -> tuple[Tensor, Tensor]:
        """(drawn, score) of the candidates (slots sinks .. fill - recent): the log attention they have drawn
        (remembered with score_memory, pooled over score_pool), and their eviction score, that less the age
        term (attention_bias times the log of their age)."""
        drawn = self.drawn(view, sinks, recent)
        return drawn, self.aged(view, drawn, sinks)

    def _apply_text_and_pin_quotas(self, view: SlotView, keep: int, sinks: int, recent: int, drawn: Tensor,
                                   score: Tensor, pin_room: int | None) -> Tensor:
        """The candidates' scores with the quotas lifted above every other candidate: `text_share` of the
        candidate slots for the text that has drawn the most attention (`drawn`, their age aside), then up to
        `pin_room` (less the pins in the recent window) for the newest pins."""
        cand = slice(sinks, view.fill - recent)
        best = keep - sinks - recent
        frame = None if view.frame is None else view.frame[:, cand]
        if self.text_share > 0.0 and frame is not None:
            # Frame tokens come by the hundred per frame and draw attention from one another; text is sparse
            # and is what a robot is told. Ranked on score alone, a camera flood pushes every text token out;
            # with a share, the text competes for its slots with other text, by the attention it has drawn
            # (a fact told long ago is no less true: with the age term each newer mention of its subject would
            # outrank it), and the rest go to whichever scores best. (Where none is text the lift lifts
            # nothing; not asking which spares the host a wait for a GPU.)
            score = _lift_first(score, ~frame, by=drawn, room=int(self.text_share * max(best, 0)))
        if pin_room is not None:
            pinned = view.pinned
            # The newest pins first: those in the recent window are kept already and use up their share.
            room = pin_room - pinned[:, view.fill - recent : view.fill].sum(-1, keepdim=True)
            score = _lift_first(score, pinned[:, cand], by=view.seq[:, cand].to(score.dtype), room=room)
        return score


def _lift_first(score: Tensor, members: Tensor, *, by: Tensor, room: int | Tensor) -> Tensor:
    """Lift the `room` members (per head: an int, or [heads, 1]) with the highest `by` in each head above
    every candidate not lifted (or all the members there are); their order among themselves, and everyone
    else's, stays by score."""
    if score.shape[-1] == 0:
        return score
    ranked = torch.where(members, by, torch.full_like(by, -torch.inf)).argsort(dim=-1, descending=True)
    rank = torch.empty_like(ranked).scatter_(-1, ranked, torch.arange(score.shape[-1], device=score.device)
                                             .expand_as(ranked))
    lifted = members & (rank < room)
    return torch.where(lifted, score + (score.abs().max() + 1.0) * 4.0, score)

