"""How often ``rlmesh train`` restarts one crashed service."""

from rlmesh.job.train import RestartBudget


def test_each_service_gets_its_own_budget_per_hour():
    now = [1000.0]
    budget = RestartBudget(2, clock=lambda: now[0])
    assert [budget.take("rollout-0"), budget.take("rollout-0"), budget.take("rollout-0")] == [1, 2, 0]
    assert budget.take("reward") == 1  # another service: its own count
    now[0] += 3599
    assert budget.take("rollout-0") == 0  # both restarts are still within the hour
    now[0] += 2
    assert budget.take("rollout-0") == 1  # they are not any more


def test_a_zero_budget_never_restarts():
    assert RestartBudget(0).take("redis") == 0
