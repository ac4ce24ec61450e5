"""Four ways to claim a version or a commit that is not so (issue 48): each was a plausible one-line bug the
rest of the suite let through (named mutants in ``tests/mutants.py`` keep them caught).

a. A joiner whose target holds step A of a rewritten store (the same step, another digest) must not get a
   differential built on the store's A: the planner matches a differential's base by digest. (Its changes
   applied to the other A would leave stale bits everywhere else, and the O(changed) checksum would not see
   them.)
b. A layout-changing pull that fails after copying a new tensor whole into a target tensor of that name,
   dtype and shape must put that tensor's old bits back (a backup that aliased the target would restore
   nothing).
c. After a failed anchor pull whose restore was refused, the target's tracked version is unknown, never
   the version it held before (the anchor-failure tests elsewhere start untracked, where both look alike).
d. A create-only commit whose first try fails before writing, while a rival's create of the same step
   lands, must not be taken as our own commit when the retry finds the key (two publishers would each
   believe they won the step).
"""

from __future__ import annotations

from deltastore.manifest import VersionRef
from deltastore.pull.planner import plan_path

from .scenarios_claims import (run_anchor_failure_marks_the_version_unknown, run_layout_failure_restores_a_copied_tensor,
                               run_rewritten_store_joiner, run_rival_create_is_not_ours)


def test_a_differential_on_another_version_of_the_held_step_is_not_planned():
    """The planner on manifests alone: the differential's base is (0, X); a target holding (0, Y) is not it."""
    from test_planner import Chain

    c = Chain()
    c.add(0, full=1000)
    for s in range(1, 5):
        c.add(s, delta=100)
    c.add(5, delta=100, diff=(0, 150))
    other = VersionRef(0, "sha256:" + "ab" * 32)  # step 0 of the store before it was rewritten
    assert plan_path(c.read, 5, c.ref(0)).differential == 5 and plan_path(c.read, 5, c.ref(0)).anchor is None
    plan = plan_path(c.read, 5, other)
    assert plan.anchor == 0 and plan.differential == 5, plan  # through the anchor, not from the target


def test_a_joiner_holding_a_rewritten_step_gets_the_new_anchor_not_a_differential_on_its_own(where):
    run_rewritten_store_joiner(where)


def test_a_failed_layout_change_restores_a_tensor_it_had_copied_whole():
    run_layout_failure_restores_a_copied_tensor()


def test_a_refused_restore_after_an_anchor_failure_leaves_a_tracked_target_unknown():
    run_anchor_failure_marks_the_version_unknown()


def test_a_rivals_create_is_not_taken_as_our_commit_on_retry(where):
    run_rival_create_is_not_ours(where)
