"""Costs: bad values fail at construction with a message naming the field and the fix."""

import math

import pytest

from zbpipe.planning import Costs, plan, simulate


@pytest.mark.parametrize(
    "field,value,phrase",
    [
        ("f", -1.0, "Costs.f must be >= 0"),
        ("w", math.nan, "Costs.w must be finite numbers"),
        ("comm", math.inf, "Costs.comm must be finite numbers"),
        ("b", [1.0, -0.5], "Costs.b must be >= 0"),
        ("f", [], "Costs.f is an empty list"),
        ("f", True, "Costs.f must be finite numbers"),
    ],
)
def test_bad_cost_values_raise(field, value, phrase):
    with pytest.raises(ValueError, match=phrase.replace(".", r"\.")):
        Costs(**{field: value})


def test_per_stage_lists_of_different_lengths_raise():
    with pytest.raises(ValueError, match="different lengths"):
        Costs(f=[1, 1], b=[1, 1, 1])


def test_wrong_number_of_stages_is_named_when_planning():
    with pytest.raises(ValueError, match="length 3 but the plan has 4 stages"):
        plan("ZBH1", 4, 8, costs=Costs(f=[1, 1, 1]))


def test_memory_that_is_never_freed_is_refused():
    with pytest.raises(ValueError, match="mem_f \\+ mem_b \\+ mem_w"):
        simulate(plan("1F1B", 2, 2), Costs(mem_f=1.0, mem_w=-0.5))


def test_split_keeps_the_model_fixed():
    # Two chunks of half the cost: the same total work, the same communication per send.
    c = Costs(f=[2.0, 4.0], comm=0.1).split(2)
    assert c.f == (1.0, 1.0, 2.0, 2.0) and c.comm == 0.1
    assert sum(c.f) == 6.0


@pytest.mark.parametrize(
    "text,phrase", [("f=1,x=2", "key=value with key in"), ("f=abc", "f must be a number")]
)
def test_cli_cost_strings_are_checked(text, phrase):
    with pytest.raises(ValueError, match=phrase):
        Costs.parse(text)


def test_joined_adds_consecutive_stages_by_hand():
    # Four stages worked by hand into two: times and memory add, comm is the second one's.
    four = Costs(
        f=[1, 2, 3, 4],
        b=[2, 2, 1, 1],
        w=0.5,
        comm=[0.1, 0.2, 0.3, 0.4],
        mem_f=[1, 1, 2, 2],
        mem_b=0,
        mem_w=[-1, -1, -2, -2],
    )
    two = four.joined(2)
    assert [two.stage(s).f for s in (0, 1)] == [3, 7]
    assert [two.stage(s).b for s in (0, 1)] == [4, 2]
    assert [two.stage(s).w for s in (0, 1)] == [1, 1]
    assert [two.stage(s).comm for s in (0, 1)] == [0.2, 0.4]
    assert [two.stage(s).mem_f for s in (0, 1)] == [2, 4]
    assert [two.stage(s).mem_w for s in (0, 1)] == [-2, -4]
    assert Costs(f=1, comm=0.05).joined(3) == Costs(
        f=3, b=3, w=3, comm=0.05, mem_f=3, mem_b=0, mem_w=-3
    )
    assert four.joined(1) == four


@pytest.mark.parametrize(
    "k,phrase", [(3, "4 stages, not a multiple of 3"), (0, "k must be"), (2.0, "k must be")]
)
def test_joined_refuses_what_it_cannot_join(k, phrase):
    with pytest.raises(ValueError, match=phrase):
        Costs(f=[1, 1, 1, 1]).joined(k)


def test_joined_undoes_split():
    c = Costs(f=[2.0, 4.0], b=[1.0, 3.0], comm=[0.1, 0.2])
    assert c.split(2).joined(2) == c
