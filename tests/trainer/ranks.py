"""Rank bodies for the trainer's 2-rank tests; ``run_ranks`` is the shared spawn harness."""

from __future__ import annotations

from tests.parallel.harness import run_ranks

__all__ = ["grpo_body", "run_ranks", "sft_resume_body"]


def sft_resume_body(rank: int, world: int, overrides_a: list[str], overrides_b: list[str]) -> None:
    """Run A: 4 steps straight. Run B: 2 steps, 'crash', then resume to 4."""
    from osvl.config import load_recipe
    from osvl.trainer import run_sft

    a = run_sft(load_recipe("tiny_sft", overrides_a), rank, world)
    assert a.steps == 4 and a.resumed_from == 0, a
    first = run_sft(load_recipe("tiny_sft", overrides_b), rank, world, stop_after=2)
    assert first.steps == 2, first
    second = run_sft(load_recipe("tiny_sft", overrides_b), rank, world)
    assert second.steps == 4 and second.resumed_from == 2, second


def grpo_body(rank: int, world: int, overrides: list[str]) -> None:
    """A few GRPO steps of the scripted policy against echo tools with injected faults."""
    from osvl.config import load_recipe
    from osvl.trainer import run_grpo
    from tests.trainer.grpo_fixtures import echo_environment, scripted

    result = run_grpo(
        load_recipe("tiny_grpo", overrides), rank, world, environment=echo_environment, engine_wrapper=scripted
    )
    assert result.steps == 2 and result.resumed_from == 0, result
