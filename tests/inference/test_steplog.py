"""Counting the engine steps an admitted call waited for (the zero-queue promise: none but the running one)."""

from __future__ import annotations

from services.inference.metrics import StepLog


def test_steps_that_began_between_receipt_and_first_step_are_counted():
    log = StepLog()
    for began_ns in (100, 200, 300, 400):
        log.add(began_ns)
    assert log.steps_began_between(150, 200) == 0  # received during the step of 100: ran in the next one
    assert log.steps_began_between(150, 400) == 2  # steps of 200 and 300 began without it
    assert log.steps_began_between(100, 300) == 1  # a step that began at the instant of receipt did not see it
    assert log.steps_began_between(450, 500) == 0  # ran in a step the log has not heard of yet


def test_the_log_keeps_only_its_capacity():
    log = StepLog(capacity=3)
    for began_ns in range(10):
        log.add(began_ns)
    assert log.steps_began_between(-1, 100) == 3
