"""What the SFT and GRPO stages set up the same way: the resumable trainer state, the metrics
writer, and the recipe's rollout settings (shared with the greedy evaluation)."""

from __future__ import annotations

import json

import pytest
import torch

from osvl.config import load_recipe
from osvl.config.recipe import SchedulerConfig
from osvl.rl.chain import EvidenceChainQueryJudge
from osvl.rl.offline_judges import ExactMatchAccuracyJudge, HeuristicQueryJudge
from osvl.trainer.checkpoint import resume_state, save_checkpoint, stage_state
from osvl.trainer.grpo_data import reward_scoring, rollout_configs
from osvl.trainer.index_stream import IndexStream
from osvl.trainer.metrics import read_metrics, stage_metrics
from osvl.trainer.optim import build_scheduler


def _parts(seed: int):
    """A model initialised from ``seed``; the stream's seed is the job's, as in a real resume."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = build_scheduler(optimizer, 10, SchedulerConfig(warmup_ratio=0.2))
    return model, optimizer, scheduler, IndexStream(12, 4, seed=3)


def _train_step(model, optimizer, scheduler, stream) -> None:
    stream.next_batch()
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def test_fresh_start_restores_nothing(tmp_path):
    model, optimizer, scheduler, stream = _parts(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert resume_state(tmp_path / "checkpoints", model, optimizer, scheduler, stream) == {}
    assert stream.state_dict() == {"epoch": 0, "index": 0} and scheduler.last_epoch == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_resume_restores_scheduler_stream_and_returns_the_stage_keys(tmp_path):
    root = tmp_path / "checkpoints"
    model, optimizer, scheduler, stream = _parts(0)
    for _ in range(3):
        _train_step(model, optimizer, scheduler, stream)
    state = stage_state(scheduler, stream, policy_version=7)
    assert set(state) == {"scheduler", "cursor", "policy_version"} and state["cursor"] == stream.state_dict()
    save_checkpoint(root, 3, model, optimizer, state)

    fresh = _parts(1)  # other weights, a new stream and schedule
    restored = resume_state(root, *fresh)
    assert restored["step"] == 3 and restored["policy_version"] == 7
    model2, _, scheduler2, stream2 = fresh
    assert stream2.state_dict() == stream.state_dict() == {"epoch": 0, "index": 12}
    assert scheduler2.last_epoch == scheduler.last_epoch == 3
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in model2.state_dict().items())
    assert stream2.next_batch() == stream.next_batch()


def test_resume_disabled_ignores_a_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    model, optimizer, scheduler, stream = _parts(0)
    _train_step(model, optimizer, scheduler, stream)
    save_checkpoint(root, 1, model, optimizer, stage_state(scheduler, stream))
    fresh = _parts(1)
    assert resume_state(root, *fresh, resume=False) == {}
    assert fresh[3].state_dict() == {"epoch": 0, "index": 0}


def test_resume_refuses_a_checkpoint_of_another_world_size(tmp_path):
    root = tmp_path / "checkpoints"
    model, optimizer, scheduler, stream = _parts(0)
    path = save_checkpoint(root, 1, model, optimizer, stage_state(scheduler, stream))
    (path / "trainer_rank0.pt").rename(path / "trainer_rank1.pt")
    with pytest.raises(ValueError, match="different world size"):
        resume_state(root, *_parts(1))


def test_stage_metrics_writes_the_recipe_header_on_rank_zero_only(tmp_path):
    recipe = load_recipe(
        "tiny_sft", [f"job.run_dir={tmp_path / 'run'}", "metrics.console=false", "metrics.tensorboard=false"]
    )
    silent = stage_metrics(recipe, rank=1)
    silent.log(1, 2, {"loss": 1.0})
    assert not (tmp_path / "run").exists()
    writer = stage_metrics(recipe, rank=0)
    writer.log(1, 2, {"loss": 1.5})
    writer.close()
    header = json.loads((tmp_path / "run" / "recipe.json").read_text())
    assert (
        header["job"]["run_dir"] == str(tmp_path / "run") and header["sft"]["global_batch"] == recipe.sft.global_batch
    )
    assert read_metrics(tmp_path / "run") == [{"step": 1, "loss": 1.5}]


def test_rollout_configs_follow_the_recipe():
    recipe = load_recipe("tiny_grpo", ["grpo.top_p=0.9", "rollout.max_retries=2"])
    g, r = recipe.grpo, recipe.rollout
    agent, workers = rollout_configs(recipe)
    assert (agent.max_turns, agent.max_total_tokens, agent.fatal.k) == (
        r.max_turns,
        g.max_prompt_tokens + g.max_response_tokens,
        g.fatal_k,
    )
    assert (agent.sampling.temperature, agent.sampling.top_p, agent.sampling.max_new_tokens) == (
        g.temperature,
        0.9,
        g.max_response_tokens,
    )
    assert (
        workers.group_size,
        workers.max_in_flight,
        workers.trajectory_deadline_s,
        workers.max_retries,
        workers.base_seed,
    ) == (g.group_size, r.max_in_flight, r.trajectory_deadline_s, 2, recipe.job.seed)


def test_reward_scoring_follows_the_recipe():
    recipe = load_recipe("tiny_grpo", ["judges.alpha=0.6", "grpo.fatal_k=2"])
    accuracy, query, config = reward_scoring(recipe)
    assert isinstance(accuracy, ExactMatchAccuracyJudge) and isinstance(query, HeuristicQueryJudge)
    assert (config.alpha, config.fatal.k) == (0.6, 2)
    _, query, _ = reward_scoring(load_recipe("tiny_grpo", ["judges.query=chain"]))
    assert isinstance(query, EvidenceChainQueryJudge)
    llm = ["judges.accuracy=llm", "judges.url=http://127.0.0.1:9/v1", "judges.model=m", "judges.overload_wait_s=7"]
    accuracy, _, _ = reward_scoring(load_recipe("tiny_grpo", llm))
    assert (accuracy.client.config.overload_wait_s, accuracy.client.config.max_attempts) == (7.0, 5)
    accuracy.client.close()


def test_greedy_evaluation_rollouts_differ_only_where_asked():
    recipe = load_recipe("tiny_grpo", ["grpo.top_p=0.9", "rollout.max_retries=2"])
    train_agent, train_workers = rollout_configs(recipe)
    agent, workers = rollout_configs(recipe, greedy=True, group_size=1, max_retries=0)
    assert (agent.sampling.temperature, agent.sampling.top_p) == (0.0, 1.0)
    assert (workers.group_size, workers.max_retries) == (1, 0)
    assert (agent.max_turns, agent.max_total_tokens, agent.fatal, agent.sampling.max_new_tokens) == (
        train_agent.max_turns,
        train_agent.max_total_tokens,
        train_agent.fatal,
        train_agent.sampling.max_new_tokens,
    )
    assert (workers.max_in_flight, workers.trajectory_deadline_s, workers.base_seed) == (
        train_workers.max_in_flight,
        train_workers.trajectory_deadline_s,
        train_workers.base_seed,
    )
