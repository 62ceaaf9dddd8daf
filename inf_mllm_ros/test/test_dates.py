"""Dates the memory can state: a marker says the day where it differs from the input before's (engine/models/chat.py), in
the clock's time zone, and a block retrieved out of its day gets its day placed before it (engine/archive/retriever.py),
while a memory of one day reads as it always did."""

from __future__ import annotations

import random
import re
from datetime import date, datetime, timedelta, timezone

import pytest
import torch

from inf_mllm_ros.engine.date_words import said_day, with_dates
from inf_mllm_ros.engine.models.chat import MarkerClock, stamped
from inf_mllm_ros.engine.models.loading import load_model
from inf_mllm_ros.engine.archive.naming import TIME_MARKER, said_words
from inf_mllm_ros.engine.runtime.stream import KVStream
from inf_mllm_ros.engine.stream_config import StreamConfig
from inf_mllm_ros.testing.random_models import build_model_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DAY = 86400.0
MAY_8 = datetime(2023, 5, 8, 13, 56, tzinfo=timezone.utc).timestamp()
WORDS = "pallet forklift aisle dock shelf crate door light scanner badge ramp conveyor".split()


def test_the_stream_clock_reads_as_before_on_its_first_day_and_says_each_later_day_once():
    clock = MarkerClock("stream")
    assert stamped("a", 5.0, clock) == "a [0:00:05.0]"
    assert clock(3599.5) == "0:59:59.5"
    assert clock(DAY + 3600) == "day 1, 1:00:00.0"
    assert clock.after(DAY + 60)(DAY + 3600) == "1:00:00.0"  # the same day: not said again
    assert clock.after(2 * DAY)(5.0) == "day 0, 0:00:05.0"  # a day that differs is said, also backwards


@pytest.mark.parametrize("offset", [0.0, 3 * 3600.0, 17 * DAY + 61.0])
def test_the_wall_clock_says_the_date_with_the_first_input_and_where_the_day_changes(offset):
    clock = MarkerClock("wall", "UTC", MAY_8 + offset)
    first = datetime.fromtimestamp(MAY_8 + offset, timezone.utc)
    assert clock(0.0) == f"{first.day} {first:%B %Y} {first:%H:%M:%S}"
    assert clock.after(0.0)(60.0) == f"{datetime.fromtimestamp(MAY_8 + offset + 60, timezone.utc):%H:%M:%S}"
    later = datetime.fromtimestamp(MAY_8 + offset + 2 * DAY, timezone.utc)
    assert clock.after(60.0)(2 * DAY) == f"{later.day} {later:%B %Y} {later:%H:%M:%S}"


def test_the_date_is_the_time_zones():
    # 23:30 on 8 May in UTC is 01:30 on 9 May in Berlin: another day there.
    late = datetime(2023, 5, 8, 23, 30, tzinfo=timezone.utc).timestamp()
    assert MarkerClock("wall", "UTC", late)(0.0) == "8 May 2023 23:30:00"
    assert MarkerClock("wall", "Europe/Berlin", late)(0.0) == "9 May 2023 01:30:00"
    assert MarkerClock("wall", "Europe/Berlin", late - 3 * 3600).after(0.0)(3 * 3600) == "9 May 2023 01:30:00"


@pytest.mark.parametrize("marker", ["[0:00:31.0]", "[day 2, 0:00:31.0]", "[08:00:31]", "[8 May 2023 08:00:31]",
                                    "[17 December 2024 23:59:59]"])
def test_what_a_message_says_leaves_out_its_marker_with_its_day(marker):
    assert TIME_MARKER.fullmatch(marker)
    assert said_words(f"the door code of the mail room is 2895 {marker}") == said_words(
        "the door code of the mail room is 2895")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return load_model(build_model_folder("llama", tmp_path_factory.mktemp("tiny") / "llama"), device="cpu",
                      dtype="float32")


class DaysPlaced(KVStream):
    """A stream that keeps the turns placed before its answers (the retriever's public seam)."""

    placed_turns: list[str]

    def place_turn(self, text: str) -> None:
        self.placed_turns.append(text)
        super().place_turn(text)


def days_stream(adapter, days: list[int], seed: int) -> DaysPlaced:
    """A small cache after messages of several days, on the wall clock: most of it archived only."""
    stream = DaysPlaced(adapter, StreamConfig(capacity=48, chunk_size=16, archive_size=4096, retrieve_tokens=96,
                                              archive_block=16, clock="wall"))
    stream.placed_turns = []
    stream.time_origin = MAY_8
    rng = random.Random(seed)
    for day in days:
        for i in range(4):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 9)))
            stream.push_text(f"{words}.", stamp=day * DAY + 60.0 * i + rng.random())
    return stream


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_block_retrieved_out_of_its_day_has_its_day_placed_before_it_and_the_cache_is_left_as_it_was(adapter, seed):
    stream = days_stream(adapter, [0, 0, 3, 3, 9], seed)
    clock = stream.marker_clock
    today = clock.day(clock.previous)
    before = {name: t.clone() for name, t in stream.cache.export_state().items()}
    answer = stream.ask("Where was the forklift at the dock?", max_new_tokens=4)
    assert answer.retrieved_tokens > 0
    days = {clock.day(s) for s in answer.retrieved_stamps if s is not None}
    said = {t[1:-1] for t in stream.placed_turns}
    assert days - {today}, "nothing of another day was retrieved: the test proves nothing"
    # Every other day's blocks come after their day; today's too where they follow another day's.
    assert days - {today} <= said <= days
    after = stream.cache.export_state()
    assert all(bool((before[n] == after[n]).all()) for n in before)


def test_a_memory_of_one_day_places_no_day(adapter):
    stream = days_stream(adapter, [0, 0, 0, 0], seed=4)
    answer = stream.ask("Where was the forklift at the dock?", max_new_tokens=4)
    assert answer.retrieved_tokens > 0
    assert stream.placed_turns == []


def test_the_day_in_force_is_saved_with_the_memory_and_said_again_after_a_reset(adapter):
    stream = days_stream(adapter, [0, 2], seed=5)
    state = stream.clock_state()
    assert state["newest_stamp"] == pytest.approx(2 * DAY + 180.0, abs=1.0)
    again = KVStream(adapter, StreamConfig(capacity=48, chunk_size=16, clock="wall"))
    again.restore_clock(state)
    assert again.marker_clock.previous == state["newest_stamp"]
    stream.reset()
    assert stream.marker_clock.previous is None  # a forgotten memory says the date with its next input


@pytest.mark.parametrize("seed", [6, 7])
def test_a_days_turn_is_computed_once_and_placed_again_as_it_was_computed(adapter, seed):
    """A day's turn goes through the model the first time it is placed; after that its keys and values are placed
    as an archived block's are, re-rotated to where they sit, with no forward."""
    stream = days_stream(adapter, [0, 3, 3, 9], seed)
    before = {name: t.clone() for name, t in stream.cache.export_state().items()}
    first = stream.ask("Where was the forklift at the dock?", max_new_tokens=4)
    computed = list(stream.placed_turns)
    assert computed, "a day was placed"
    stream.placed_turns.clear()
    again = stream.ask("Where was the forklift at the dock?", max_new_tokens=4)
    assert stream.placed_turns == [], "no forward for a day already computed"
    assert again.retrieved_tokens == first.retrieved_tokens and again.retrieved_stamps == first.retrieved_stamps
    after = stream.cache.export_state()
    assert all(bool((before[n] == after[n]).all()) for n in before)


def test_a_days_turn_placed_again_has_the_first_layers_keys_a_forward_gives_there(adapter):
    """The first layer's keys depend on the tokens and their positions only: the kept turn, re-rotated to where it
    sits, has the keys a forward of it there gives."""
    stream = days_stream(adapter, [0, 3, 9], seed=8)
    stream.ask("Where was the forklift at the dock?", max_new_tokens=2)
    turn = stream.placed_turns[0]
    fill, frontiers = stream.cache.fill, stream.cache.frontiers()
    assert stream.retriever.place_day(turn, spare=1000) > 0  # placed again, kept
    spliced, _, start, _ = stream.cache.tail(fill)
    stream.cache.truncate(fill, frontiers)
    stream.place_turn(turn)  # a forward of it at the same place
    forwarded, _, start_again, _ = stream.cache.tail(fill)
    stream.cache.truncate(fill, frontiers)
    assert torch.equal(start, start_again)
    torch.testing.assert_close(spliced[0], forwarded[0], atol=1e-4, rtol=1e-4)


# --- relative dates (engine/date_words.py) ------------------------------------------------------------------------
def _some_days(seed: int, n: int = 12) -> list[date]:
    """Days of several years, month ends and a year's turn among them."""
    rng = random.Random(seed)
    return [date(2023, 1, 1), date(2024, 3, 1), date(2024, 12, 31)] + [
        date(2021, 1, 1) + timedelta(days=rng.randrange(6 * 365)) for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_day_said_relative_to_the_text_is_followed_by_its_date(seed):
    for day in _some_days(seed):
        assert with_dates("I went there yesterday.", day) == f"I went there yesterday ({said_day(day - timedelta(1))})."
        assert with_dates("Last night was loud", day) == f"Last night ({said_day(day - timedelta(1))}) was loud"
        assert with_dates("see you tomorrow", day) == f"see you tomorrow ({said_day(day + timedelta(1))})"
        assert with_dates("three days ago", day) == f"three days ago ({said_day(day - timedelta(3))})"
        for index, name in enumerate(["Monday", "Tues", "wed", "Thursday", "Fri", "Saturday", "sun"]):
            past = re.fullmatch(r"last \w+ \((.+)\)", with_dates(f"last {name}", day))[1]
            ahead = re.fullmatch(r"next \w+ \((.+)\)", with_dates(f"next {name}", day))[1]
            past, ahead = (datetime.strptime(d, "%d %B %Y").date() for d in (past, ahead))
            assert past.weekday() == index == ahead.weekday()
            assert 1 <= (day - past).days <= 7 and 1 <= (ahead - day).days <= 7


@pytest.mark.parametrize("seed", [3, 4])
def test_a_span_a_month_or_a_year_is_said_against_the_texts_day(seed):
    for day in _some_days(seed):
        month_before = (day.replace(day=1) - timedelta(1)).strftime("%B %Y")
        month_after = (day.replace(day=28) + timedelta(5)).strftime("%B %Y")
        assert with_dates("last week", day) == f"last week (the week before {said_day(day)})"
        assert with_dates("this past weekend", day) == f"this past weekend (the weekend before {said_day(day)})"
        assert with_dates("two weeks ago", day) == f"two weeks ago (two weeks before {said_day(day)})"
        assert with_dates("Last month", day) == f"Last month ({month_before})"
        assert with_dates("next month", day) == f"next month ({month_after})"
        assert with_dates("ten years ago", day) == f"ten years ago ({day.year - 10})"
        assert with_dates("last year", day) == f"last year ({day.year - 1})"


@pytest.mark.parametrize("text", ["I go twice a week and once a month.", "Since we last spoke, a lot happened.",
                                  "I have known them for 4 years.", "The last sunset was red.", "Monday is busy."])
def test_words_that_are_no_date_are_left_as_they_are(text):
    assert with_dates(text, date(2023, 7, 15)) == text


def test_a_text_resolved_before_reads_the_same():
    once = with_dates("Yesterday and last Friday, and last month too.", date(2023, 7, 15))
    assert once == "Yesterday (14 July 2023) and last Friday (14 July 2023), and last month (June 2023) too."
    assert with_dates(once, date(2023, 7, 15)) == once


@pytest.mark.parametrize("offset_days", [0, 5, 40])
def test_the_memory_holds_the_date_a_texts_yesterday_means_on_the_wall_clock_only(adapter, offset_days):
    """What the model read: the evidence of a recall quotes the text as it went in."""
    stamp = offset_days * DAY + 3600.0
    said = datetime.fromtimestamp(MAY_8 + stamp, timezone.utc).date()
    for clock, resolve, dated in (("wall", True, True), ("wall", False, False), ("stream", True, False)):
        stream = KVStream(adapter, StreamConfig(capacity=64, chunk_size=16, clock=clock, resolve_dates=resolve))
        stream.time_origin = MAY_8
        stream.push_text("The pallet jack broke yesterday.", stamp=stamp)
        quoted = stream.recall("pallet jack", limit=1)[0].text
        expected = f"yesterday ({said_day(said - timedelta(1))})" if dated else "yesterday."
        assert expected in quoted, (clock, resolve, quoted)
