"""``Recipe.check_stage``: what a stage refuses from the recipe alone, given its data-parallel size."""

from __future__ import annotations

import pytest

from osvl.config import Recipe, load_recipe
from osvl.config.recipe import GRPOConfig, JobConfig, RolloutConfig, ToolsConfig

GRPO = JobConfig(stage="grpo")
SERVED_TOOLS = ToolsConfig(servers=("http://127.0.0.1:8100",))


def test_offline_tools_need_a_world_and_served_tools_do_not():
    with pytest.raises(ValueError, match="tools.world_dir must name a world directory"):
        Recipe(job=GRPO, tools=ToolsConfig(backend="offline")).check_stage(1)
    Recipe(job=GRPO, tools=SERVED_TOOLS).check_stage(1)
    Recipe(job=GRPO, tools=ToolsConfig(world_dir="world")).check_stage(1)


def test_online_tools_need_a_config_file():
    with pytest.raises(ValueError, match="tools.backend = 'online' needs tools.config_file"):
        Recipe(job=GRPO, tools=ToolsConfig(backend="online")).check_stage(1)
    Recipe(job=GRPO, tools=ToolsConfig(backend="online", config_file="tools.toml")).check_stage(1)


def test_engine_choices_the_stage_cannot_run():
    with pytest.raises(ValueError, match="rollout.engine = 'local' keeps an unsharded generation copy"):
        load_recipe("grpo_8b", ["rollout.engine=local"]).check_stage(64)
    vllm = RolloutConfig(engine="vllm", vllm_urls=("http://v:8000",), deterministic=True)
    with pytest.raises(ValueError, match="rollout.deterministic: osvl cannot check"):
        Recipe(job=GRPO, rollout=vllm, tools=SERVED_TOOLS).check_stage(1)


def test_kl_and_the_data_parallel_split():
    with pytest.raises(ValueError, match="grpo.kl_coef > 0 needs a reference policy"):
        Recipe(job=GRPO, grpo=GRPOConfig(kl_coef=0.1), tools=SERVED_TOOLS).check_stage(1)
    split = Recipe(job=GRPO, grpo=GRPOConfig(batch_prompts=8, mini_batch_prompts=4), tools=SERVED_TOOLS)
    split.check_stage(4)
    with pytest.raises(ValueError, match="grpo.mini_batch_prompts 4 must be a multiple of the data-parallel size 3"):
        split.check_stage(3)


def test_an_sft_recipe_is_not_held_to_the_grpo_stage():
    sft = Recipe(job=JobConfig(stage="sft"), tools=ToolsConfig(backend="offline"), grpo=GRPOConfig(kl_coef=0.1))
    sft.check_stage(3)


def test_url_checks_stay_field_level():
    with pytest.raises(ValueError, match="sglang_urls must be http"):
        RolloutConfig(engine="sglang", sglang_urls=("localhost:30000",))
    with pytest.raises(ValueError, match="servers must be http"):
        ToolsConfig(servers=("tools:8100",))
