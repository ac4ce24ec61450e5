"""The target/publisher fault families of bench/faults.py, a few trials each: every promise holds."""

from __future__ import annotations

import pytest

from . import scenarios_target as T


@pytest.mark.parametrize("family, trials", [(T.run_layout_changes, 4), (T.run_aliasing, 10),
                                            (T.run_interrupts, 12), (T.run_post_commit, 4)],
                         ids=["layout", "aliasing", "interrupts", "post-commit"])
def test_target_family_keeps_every_promise(family, trials):
    stats = family(trials, seed=3)
    assert stats.trials == trials
    assert stats.faults > 0, "no fault was injected: the family tests nothing"
    assert (stats.wrong, stats.lost, stats.untyped) == (0, 0, 0), stats.problems
    assert not stats.problems, stats.problems
