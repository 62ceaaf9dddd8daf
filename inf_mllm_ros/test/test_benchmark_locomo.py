"""The LoCoMo benchmark's reading and scoring (`benchmarks/locomo.py`): LoCoMo's token F1 and its multi-hop and
adversarial rules, whether an answer names the gold's date, and the conversations read in order with their
sessions' dates (from the data folder beside the checkout, where it is)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("benchmark_locomo", REPO_ROOT / "benchmarks" / "locomo.py")
locomo = importlib.util.module_from_spec(spec)
sys.modules["benchmark_locomo"] = locomo  # its dataclasses look their module up
spec.loader.exec_module(locomo)


@pytest.mark.parametrize("answer, gold, expected", [
    ("7 May 2023", "7 May 2023", 1.0),
    ("On May 7, 2023.", "7 May 2023", 6 / 7),  # "on" is the one word too many
    ("The pottery class", "pottery class", 1.0),  # articles do not count
    ("Sunset", "a sunset with a palm tree", 0.4),
    ("nothing like it", "pottery", 0.0),
])
def test_token_f1_is_locomos(answer, gold, expected):
    assert locomo.token_f1(answer, gold) == pytest.approx(expected, abs=1e-3)


def test_multi_hop_takes_each_gold_part_against_the_best_answer_part():
    assert locomo.multi_f1("running, pottery", "Running, pottery") == 1.0
    assert locomo.multi_f1("running", "Running, pottery") == 0.5
    assert locomo.score(1, "pottery and running", "Running, pottery") == pytest.approx(2 / 3)  # one part, two words


@pytest.mark.parametrize("answer, right", [
    ("It was not mentioned.", True), ("There is no information about that.", True), ("I don't know.", True),
    ("She realised self-care is important.", False), ("", False),
])
def test_an_adversarial_answer_is_right_where_it_says_it_was_not_said(answer, right):
    assert locomo.score(5, answer, "Not mentioned in the conversation") == float(right)


@pytest.mark.parametrize("answer, gold, named", [
    ("On 7 May 2023.", "7 May 2023", True),
    ("May 7th", "7 May 2023", True),
    ("2023-05-07", "7 May 2023", True),
    ("8 May 2023", "7 May 2023", False),  # the day of the session, not the day before it
    ("In May 2023", "7 May 2023", False),  # a day is asked: a month does not name it
    ("The week before 9 June 2023", "The week before 9 June 2023", True),
    ("In June, 2023", "June 2023", True),
    ("On 3 June 2023", "June 2023", True),
    ("In June 2022", "June 2023", False),
    ("2022", "2022", True),
    ("Last year", "2022", False),
    ("On 14 July 2023", "The Friday before 15 July 2023", True),  # the day the gold means
    ("On 15 July 2023", "The Friday before 15 July 2023", True),  # the day the gold names
    ("On 13 July 2023", "The Friday before 15 July 2023", False),
    ("21 May 2023", "The sunday before 25 May 2023", True),
    ("20 May 2023", "The sunday before 25 May 2023", False),
    ("6 March", "The day before 7 March 2023", True),
])
def test_an_answer_names_the_gold_date_by_day_and_month_or_month_and_year_or_year(answer, gold, named):
    assert locomo.names_gold_date(answer, gold) is named


def test_a_gold_without_a_date_is_not_judged_on_dates():
    assert locomo.names_gold_date("last week", "last week") is None


@pytest.mark.skipif(not (locomo.DATA / "26.json").exists(), reason="the LoCoMo data folder is not beside the checkout")
@pytest.mark.parametrize("name", ["26", "41"])
def test_a_conversation_is_read_in_order_at_its_sessions_dates(name):
    turns, questions, origin = locomo.load_conversation(locomo.DATA, name)
    stamps = [t.stamp for t in turns]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    assert turns[0].stamp == 0.0 and stamps[-1] > 30 * 86400  # months of sessions
    assert all(":" in t.text for t in turns)
    said = {t.dia_id for t in turns}
    assert {q.category for q in questions} == set(locomo.CATEGORIES)
    # Nearly every question's evidence is among the turns (a few annotations in the release name none that are).
    assert sum(bool(set(q.evidence) & said) for q in questions) >= 0.95 * len(questions)
    drawn = locomo.chosen_questions(questions, 5, seed=1)
    assert len(drawn) == 5 * len(locomo.CATEGORIES) and drawn == sorted(drawn, key=lambda q: q.index)
    assert drawn != locomo.chosen_questions(questions, 5, seed=2)
    # Later draws among what earlier runs never asked: each earlier draw made among what the ones before it left.
    second = locomo.chosen_questions(questions, 5, seed=2, not_drawn_by=((5, 1),))
    third = locomo.chosen_questions(questions, 5, seed=3, not_drawn_by=((5, 1), (5, 2)))
    asked = [{q.index for q in d} for d in (drawn, second, third)]
    assert all(asked) and not (asked[0] & asked[1] or asked[0] & asked[2] or asked[1] & asked[2])


def test_the_bootstrap_interval_holds_the_mean_and_narrows_with_more_questions():
    few = locomo.bootstrap([1.0, 0.0] * 10)
    many = locomo.bootstrap([1.0, 0.0] * 200)
    assert few[0] < 0.5 < few[1] and many[0] < 0.5 < many[1]
    assert many[1] - many[0] < few[1] - few[0]


def test_every_setting_names_node_parameters():
    """A key the parameter table does not read would run the shipped setting under another name."""
    from inf_mllm_ros.settings import DEFAULTS

    for name, values in locomo.SETTINGS.items():
        assert values is None or set(values) <= set(DEFAULTS), name


def test_the_speaker_checks_answer_counts_as_said_not_mentioned_and_its_counts_are_summed_per_depth():
    from inf_mllm_ros.engine.archive.attribution import not_mentioned

    assert locomo.score(5, not_mentioned("Joanna"), "Not mentioned in the conversation") == 1.0
    rows = [{"category": c, "not_mentioned": {"1": c == 5 or i % 2 == 0, "2": c == 5 and i % 3 == 0}}
            for i, c in enumerate([1, 2, 4, 5, 5, 5])]
    cell = locomo.cell(rows)
    assert cell["adversarial"]["check_not_mentioned"]["1"]["mean"] == 1.0
    assert cell["adversarial"]["check_not_mentioned"]["2"]["mean"] == pytest.approx(1 / 3, abs=1e-3)
    assert cell["all"]["check_not_mentioned"]["1"]["mean"] == pytest.approx(5 / 6, abs=1e-3)
