"""The long stages are typed: the operator runs a Stage through the target's table, and a
deferred stage resumes only with a method its target marked @resumes."""

from __future__ import annotations

import pytest

from finetune.operators import StageOperator
from finetune.targets import get_target
from finetune.targets.base import Stage, Wait, resumes
from finetune.targets.eks.target import EksTarget


def test_every_long_stage_is_a_method_of_every_target():
    for name in ("local", "eks"):
        target = get_target(name)
        for stage in Stage:
            assert callable(getattr(target, stage.value)), (name, stage)


def test_an_operator_for_a_stage_that_is_not_a_long_stage_is_refused():
    with pytest.raises(ValueError, match="'teardown' is not a valid Stage"):
        StageOperator(task_id="teardown", stage="teardown", run_config={})
    assert StageOperator(task_id="train", stage="train", run_config={}).stage is Stage.TRAIN


def test_a_wait_resumes_only_with_a_method_marked_resumes():
    target = EksTarget()
    assert {"nodes_ready", "job_wake", "build_done"} <= EksTarget.RESUMERS
    assert target.resumer("job_wake") == target.job_wake
    with pytest.raises(ValueError, match="no stage to resume named 'teardown'"):
        target.resumer("teardown")  # a method, but not one a deferred task may call back
    with pytest.raises(TypeError, match="not a method marked @resumes"):
        Wait(trigger=None, resume=target.teardown, state={})
    assert Wait(trigger=None, resume=target.job_wake, state={}).resume_name == "job_wake"


def test_a_subclass_keeps_its_parents_resumers_and_adds_its_own():
    class Slower(EksTarget):
        @resumes
        def after_a_nap(self, cfg, event, state):
            return {}

    assert Slower.RESUMERS == EksTarget.RESUMERS | {"after_a_nap"}
