"""The step planner as tables: for a batch of rows, which entries each forward holds (row, offset from its last
token, input sources, adapter on, logits), and which buffer indices each row commits. Buffer index of drafting
pass j's entry i: j * width + i; the verify pass's outputs follow the last drafting pass."""

import pytest

from engine_ext.speculation.plan import Entry, Kind, Planner, Row

DRAFT, RIDE, PLAIN, PROMPT = Kind.DRAFT, Kind.RIDE, Kind.PLAIN, Kind.PROMPT


def E(row, offset, srcs, lora, prompt=False, logits=1):  # noqa: N802 - reads as a table
    return Entry(row, offset, srcs, lora, prompt, logits)


def plan_all(rows, passes, width, pass_tokens=None, arrivals=None):
    """Plan every pass; arrivals: {pass j: rows added before it (j = passes: before the verify pass)}."""
    planner = Planner(passes, width, pass_tokens)
    planner.add(rows)
    for j in range(passes):
        planner.add((arrivals or {}).get(j, []))
        planner.next_pass()
    planner.add((arrivals or {}).get(passes, []))
    planner.verify_pass()
    return planner.plan


CASES = {
    "plain step: every row in the one adapter-on pass": dict(
        rows=[Row(PLAIN), Row(RIDE, left=9), Row(PROMPT, need=3)], passes=0, width=4,
        forwards=[[E(0, 0, [-1], True), E(1, 0, [-1], True), E(2, 0, [-1, -1, -1], True, prompt=True)]],
        fixed=[[], [], []], verified=[[0], [1], [2]], drafts=[[], [], []]),
    "two passes: drafters, a rider, a plain row": dict(
        rows=[Row(DRAFT, drafts=2), Row(DRAFT, drafts=1), Row(RIDE, left=10), Row(PLAIN)], passes=2, width=4,
        forwards=[[E(0, 0, [-1], False), E(1, 0, [-1], False), E(2, 0, [-1], True)],
                  [E(0, 1, [0], False), E(2, 1, [2], True)],
                  [E(0, 0, [-1, 0, 4], True, logits=3), E(1, 0, [-1, 1], True, logits=2), E(2, 2, [5], True),
                   E(3, 0, [-1], True)]],
        fixed=[[], [], [2, 5], []], verified=[[8, 9, 10], [11, 12], [13], [14]], drafts=[[0, 4], [1], [], []]),
    "a prompt in the first pass drafts from its first token": dict(
        rows=[Row(DRAFT, drafts=3), Row(PROMPT, drafts=2, left=10, need=5)], passes=3, width=2,
        forwards=[[E(0, 0, [-1], False), E(1, 0, [-1] * 5, True, prompt=True)],
                  [E(0, 1, [0], False), E(1, 1, [1], False)],
                  [E(0, 2, [2], False), E(1, 2, [3], False)],
                  [E(0, 0, [-1, 0, 2, 4], True, logits=4), E(1, 1, [1, 3, 5], True, logits=3)]],
        fixed=[[], [1]], verified=[[6, 7, 8, 9], [10, 11, 12]], drafts=[[0, 2, 4], [3, 5]]),
    "a rider whose tokens run out rides no verify pass": dict(
        rows=[Row(DRAFT, drafts=2), Row(RIDE, left=2)], passes=2, width=2,
        forwards=[[E(0, 0, [-1], False), E(1, 0, [-1], True)], [E(0, 1, [0], False), E(1, 1, [1], True)],
                  [E(0, 0, [-1, 0, 2], True, logits=3)]],
        fixed=[[], [1, 3]], verified=[[4, 5, 6], []], drafts=[[0, 2], []]),
    "a prompt without drafts rides, one that draws from its history waits for the verify pass": dict(
        rows=[Row(DRAFT, drafts=1), Row(PROMPT, left=5, need=2), Row(PROMPT, left=5, need=2, late=True)],
        passes=1, width=3,
        forwards=[[E(0, 0, [-1], False), E(1, 0, [-1, -1], True, prompt=True)],
                  [E(0, 0, [-1, 0], True, logits=2), E(1, 1, [1], True), E(2, 0, [-1, -1], True, prompt=True)]],
        fixed=[[], [1], []], verified=[[3, 4], [5], [6]], drafts=[[0], [], []]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_plan(name):
    case = CASES[name]
    plan = plan_all(case["rows"], case["passes"], case["width"])
    assert [f.entries for f in plan.forwards] == case["forwards"]
    assert (plan.fixed, plan.verified, plan.drafts) == (case["fixed"], case["verified"], case["drafts"])
    assert not plan.deferred and not plan.paced


def test_prompts_wait_for_a_pass_with_room():
    """pass_tokens 10: pass 0 (two riders) takes the first prompt of 6, pass 1 (three decoding rows) the second,
    the verify pass the third; the two later ones were paced."""
    rows = [Row(RIDE, left=100), Row(RIDE, left=100), Row(PROMPT, need=6, left=50), Row(PROMPT, need=6, left=50),
            Row(PROMPT, need=3, left=50)]
    plan = plan_all(rows, passes=2, width=8, pass_tokens=10)
    assert [[e.row for e in f.entries if e.prompt] for f in plan.forwards] == [[2], [3], [4]]
    assert all(f.tokens <= 10 for f in plan.forwards)
    assert plan.paced == {3, 4} and not plan.deferred
    assert plan.firsts == [[2], [3]]


def test_a_step_first_prompt_runs_whatever_its_size_and_a_burst_runs_at_once():
    big = plan_all([Row(RIDE, left=9), Row(PROMPT, need=30, left=9)], passes=1, width=4, pass_tokens=10)
    assert [e.row for e in big.forwards[0].entries if e.prompt] == [1]  # over the limit, but the step's first
    burst = [Row(RIDE, left=9)] + [Row(PROMPT, need=8, left=9) for _ in range(6)]  # 48 tokens > all the room left
    plan = plan_all(burst, passes=2, width=8, pass_tokens=10)
    assert [e.row for e in plan.forwards[0].entries if e.prompt] == [1, 2, 3, 4, 5, 6] and not plan.paced


def test_a_prompt_no_forward_has_room_for_waits_for_the_next_step():
    rows = [Row(DRAFT, drafts=1) for _ in range(6)] + [Row(PROMPT, need=5, left=9), Row(PROMPT, need=5, left=9)]
    plan = plan_all(rows, passes=1, width=8, pass_tokens=13)
    assert [e.row for e in plan.forwards[0].entries if e.prompt] == [6]
    assert plan.deferred == [7] and plan.verified[7] == [] and plan.fixed[7] == []


def test_arrivals_join_the_passes_left():
    plan = plan_all([Row(DRAFT, drafts=3)], passes=3, width=4,
                    arrivals={1: [Row(PROMPT, need=2, drafts=1, left=9)], 3: [Row(PROMPT, need=4, left=9)]})
    assert plan.forwards[1].entries[1] == E(1, 0, [-1, -1], True, prompt=True)
    assert plan.forwards[2].entries[1] == E(1, 1, [5], False)  # its one draft, from its first token
    assert plan.forwards[3].entries[1:] == [E(1, 1, [5, 9], True, logits=2), E(2, 0, [-1] * 4, True, prompt=True)]
    assert plan.fixed[1] == [5] and plan.drafts[1] == [9]


def test_a_pass_wider_than_its_buffer_is_refused():
    with pytest.raises(ValueError, match="width"):
        plan_all([Row(RIDE, left=9)] * 3, passes=1, width=2)
