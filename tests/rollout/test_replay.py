"""The replay buffer: group versions (oldest token), lag in weight syncs, the staleness bound at its
edges, oldest-ticket-first order, capacity, checkpoint state, and the batch's staleness metrics."""

from __future__ import annotations

import io

import pytest
import torch

from osvl.rl.trajectory import FinishReason, Prompt, Step, Trajectory
from osvl.rollout.replay import ReplayBuffer, ScoredGroup, Ticket, lag, staleness_metrics


def trajectory(*versions: int | list[int], tokens: int = 2) -> Trajectory:
    """One step per entry: an int is the step's version, a list the per-token versions of a step that
    spanned an update."""
    steps = []
    for v in versions:
        if isinstance(v, list):
            steps.append(Step(list(range(len(v))), [0.0] * len(v), policy_version=v[0], token_versions=v))
        else:
            steps.append(Step(list(range(tokens)), [0.0] * tokens, policy_version=v))
    return Trajectory(Prompt("p", "q", answer="a"), steps, FinishReason.RESPONSE, 0, 0)


def group(batch: int, position: int, *versions, samples: int = 2) -> ScoredGroup:
    return ScoredGroup(Ticket(batch, position, position), [trajectory(*versions) for _ in range(samples)])


def test_lag_counts_weight_syncs():
    assert lag(4, 4, 2) == 0 and lag(2, 4, 2) == 1 and lag(0, 4, 2) == 2
    assert lag(3, 4, 2) == 1  # a version between two syncs counts as the older one's distance, rounded up
    assert lag(6, 4, 2) == 0  # never negative
    with pytest.raises(ValueError, match="updates_per_step"):
        lag(0, 1, 0)


def test_group_version_is_its_oldest_token():
    assert group(0, 0, 4, 6).version == 4
    spanning = ScoredGroup(Ticket(0, 0, 0), [trajectory(6), trajectory([2, 2, 4])])
    assert spanning.version == 2
    empty = ScoredGroup(Ticket(0, 0, 0), [Trajectory(Prompt("p", "q"), [], FinishReason.INFRA_ERROR, 0, 0)])
    assert empty.version is None


def test_bound_is_inclusive_and_stale_groups_leave():
    buffer = ReplayBuffer(capacity=8, max_staleness=1, updates_per_step=2)
    for g in (group(0, 0, 0), group(1, 0, 2), group(2, 0, 4)):
        buffer.put(g)
    assert [buffer.is_fresh(g, 4) for g in buffer.groups] == [False, True, True]  # lags 2, 1, 0
    stale = buffer.drop_stale(4)
    assert [g.ticket.batch for g in stale] == [0] and len(buffer) == 2
    synchronous = ReplayBuffer(capacity=8, max_staleness=0, updates_per_step=2)
    assert synchronous.is_fresh(group(0, 0, 4), 4) and not synchronous.is_fresh(group(0, 0, 2), 4)
    assert synchronous.is_fresh(ScoredGroup(Ticket(0, 0, 0), []), 100)  # no token: nothing can be stale


def test_oldest_ticket_first_capacity_and_duplicates():
    buffer = ReplayBuffer(capacity=3, max_staleness=0, updates_per_step=1)
    for g in (group(1, 1, 0), group(0, 3, 0), group(1, 0, 0)):
        buffer.put(g)
    with pytest.raises(RuntimeError, match="replay buffer full"):
        buffer.put(group(2, 0, 0))
    assert [(g.ticket.batch, g.ticket.position) for g in buffer.take(2)] == [(0, 3), (1, 0)]
    with pytest.raises(ValueError, match="already in the replay buffer"):
        buffer.put(group(1, 1, 0))
    with pytest.raises(ValueError, match="asked for 2 groups, 1"):
        buffer.take(2)
    assert Ticket(0, 3, 3).regenerated() == Ticket(0, 3, 3, attempt=1)


def test_state_survives_a_checkpoint_file():
    buffer = ReplayBuffer(capacity=4, max_staleness=1, updates_per_step=1)
    for g in (group(0, 1, 0), group(1, 0, [1, 1, 2])):
        buffer.put(g)
    stream = io.BytesIO()
    torch.save(buffer.state_dict(), stream)  # as the stage's trainer state is saved
    stream.seek(0)
    restored = ReplayBuffer(capacity=4, max_staleness=1, updates_per_step=1)
    restored.load_state_dict(torch.load(stream, weights_only=False))
    assert [g.ticket for g in restored.groups] == [g.ticket for g in buffer.groups]

    def steps(group):
        return [
            [(s.token_ids, s.logprobs, s.policy_version, s.token_versions) for s in t.steps] for t in group.trajectories
        ]

    assert [steps(g) for g in restored.groups] == [steps(g) for g in buffer.groups]


def test_staleness_metrics_of_a_batch():
    groups = [group(0, 0, 4, 4), ScoredGroup(Ticket(1, 0, 0), [trajectory(2, [2, 4]), trajectory(4)])]
    metrics = staleness_metrics(groups, current=4, updates_per_step=2)
    assert metrics["group_lag_mean"] == 0.5 and metrics["group_lag_max"] == 1.0
    # tokens: group 0: 2 x (2 + 2) at lag 0; group 1: (2 at lag 1) + (1 at lag 1, 1 at lag 0), then 2 at lag 0
    assert metrics["offpolicy_token_frac"] == pytest.approx(3 / 14)
    assert metrics["token_lag_mean"] == pytest.approx(3 / 14)
    assert metrics["mixed_version_trajectories"] == 1.0
