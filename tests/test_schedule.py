"""Learning-rate schedules."""

import math

import pytest

from scaletrain.train.schedule import lr_at


def lrs(schedule, total=100, warmup=10, **kw):
    return [lr_at(s, total, lr=1.0, warmup_steps=warmup, schedule=schedule, min_lr_ratio=0.1, **kw)
            for s in range(total)]


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_warmup_rises_linearly_to_the_peak(schedule):
    values = lrs(schedule)
    assert values[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert max(values) == pytest.approx(1.0)


def test_cosine_decays_monotonically_to_the_floor():
    values = lrs("cosine")
    assert all(a >= b for a, b in zip(values[9:], values[10:]))
    assert values[-1] == pytest.approx(0.1)
    middle = 10 + (99 - 10) / 2
    assert lr_at(int(middle), 100, lr=1.0, warmup_steps=10, schedule="cosine") == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (int(middle) - 10) / 89)))


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_the_last_update_is_at_the_floor_even_right_after_warmup(schedule):
    assert lr_at(9, 10, lr=1.0, warmup_steps=9, schedule=schedule, min_lr_ratio=0.1) == pytest.approx(0.1)


def test_wsd_is_flat_then_decays_linearly_over_the_last_fraction():
    values = lrs("wsd", decay_fraction=0.2)
    assert values[10:80] == pytest.approx([1.0] * 70)
    assert values[-1] == pytest.approx(0.1)
    steps = [a - b for a, b in zip(values[80:], values[81:])]
    assert steps == pytest.approx([steps[0]] * len(steps))


def test_constant_stays_at_the_peak():
    assert lrs("constant")[10:] == pytest.approx([1.0] * 90)


def test_no_warmup_starts_at_the_peak():
    assert lrs("cosine", warmup=0)[0] == pytest.approx(1.0)


@pytest.mark.parametrize("shape", ["linear", "1-sqrt", "cosine"])
def test_a_wsd_decay_of_each_shape_falls_from_the_peak_to_the_floor_by_its_formula(shape):
    values = lrs("wsd", decay_fraction=0.2, decay_shape=shape)
    assert values[10:80] == pytest.approx([1.0] * 70) and values[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(values[79:], values[80:]))
    progress = (90 - 80 + 1) / 20  # the update at step 90 of the 20-update decay from step 80
    fallen = {"linear": progress, "1-sqrt": math.sqrt(progress), "cosine": (1 - math.cos(math.pi * progress)) / 2}
    assert values[90] == pytest.approx(1.0 - 0.9 * fallen[shape])
    # 1-sqrt falls fastest at first (Hägele et al. 2024), cosine slowest.
    assert lrs("wsd", decay_shape="1-sqrt")[85] < lrs("wsd")[85] < lrs("wsd", decay_shape="cosine")[85]
