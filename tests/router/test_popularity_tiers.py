import pytest

from router.popularity import PopularityTracker


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_share_and_decay():
    clock = Clock()
    p = PopularityTracker(half_life_s=10.0, clock=clock)
    for _ in range(3):
        p.record("hot")
    p.record("cold")
    assert p.share("hot") == pytest.approx(0.75)
    assert p.count("hot") == pytest.approx(3.0)
    clock.t = 10.0
    assert p.count("hot") == pytest.approx(1.5)
    assert p.share("hot") == pytest.approx(0.75)  # both decay alike
    for _ in range(6):
        p.record("cold")
    assert p.share("cold") > p.share("hot")
    assert p.share("never") == 0.0


def test_prunes_coldest_entries():
    clock = Clock()
    p = PopularityTracker(half_life_s=10.0, clock=clock, max_entries=10)
    for i in range(30):
        clock.t = float(i)
        p.record(f"a{i}")
    assert p.count("a29") > 0.9
    assert p.count("a0") == 0.0


def test_rejects_bad_half_life():
    with pytest.raises(ValueError):
        PopularityTracker(half_life_s=0)
