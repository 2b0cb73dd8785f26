"""Recipe loading: every shipped recipe validates, paper numbers land where Table 4/5 put them,
and bad keys, types and values fail with the key path before anything starts."""

from __future__ import annotations

import pytest

from osvl.config import (
    GRPOConfig,
    Recipe,
    apply_overrides,
    build,
    load_recipe,
    parse_override,
    recipe_to_dict,
    resolve_recipe_path,
)
from osvl.config.loader import RECIPES_DIR

SHIPPED = [
    "sft_8b",
    "sft_30b_moe",
    "sft_32b",
    "grpo_8b",
    "grpo_30b_moe",
    "grpo_32b",
    "tiny_sft",
    "tiny_grpo",
    "tiny_grpo_services",
    "tiny_base",
]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipes_validate(name):
    recipe = load_recipe(name)
    assert recipe.job.name == name
    assert isinstance(recipe, Recipe)


def test_every_recipe_file_is_covered():
    assert sorted(p.stem for p in RECIPES_DIR.glob("*.toml")) == sorted(SHIPPED)


def test_sft_recipes_follow_table4():
    for name, preset in [("sft_8b", "qwen3_vl_8b"), ("sft_30b_moe", "qwen3_vl_30b_a3b"), ("sft_32b", "qwen3_vl_32b")]:
        r = load_recipe(name)
        assert r.model.preset == preset and not r.model.freeze_vision
        assert (r.sft.epochs, r.sft.global_batch, r.job.world_size) == (8, 256, 256)
        assert (r.scheduler.kind, r.scheduler.warmup_ratio) == ("cosine", 0.1)
        assert r.parallel.param_dtype == "bfloat16" and r.parallel.activation_checkpoint == "full"
        assert r.checkpoint.every_steps == 400


def test_grpo_recipes_follow_table5():
    dense, moe = load_recipe("grpo_8b"), load_recipe("grpo_30b_moe")
    for r in (dense, moe):
        g = r.grpo
        assert (g.temperature, g.top_p, g.eps_high, g.estimator) == (0.7, 1.0, 0.28, "rloo")
        assert (g.loss_agg, g.fatal_mode, g.batch_prompts, g.kl_coef, g.entropy_coef) == (
            "seq-mean-token-sum",
            "fatal_clamp",
            256,
            0.0,
            0.0,
        )
        assert r.job.world_size == 64 and r.job.seed == 3407
    assert (dense.grpo.group_size, dense.grpo.mini_batch_prompts, dense.parallel.ep) == (8, 64, 1)
    assert (moe.grpo.group_size, moe.grpo.mini_batch_prompts, moe.parallel.ep) == (16, 128, 8)


def test_overrides_are_typed():
    r = load_recipe(
        "grpo_8b",
        [
            "grpo.eps_high=0.3",
            "job.seed=7",
            "model.pretrained=/x/y",
            "grpo.estimator=grpo",
            "optimizer.betas=[0.9, 0.95]",
            "checkpoint.export_hf=false",
            "grpo.temperature=1",
        ],
    )
    assert r.grpo.eps_high == 0.3 and r.job.seed == 7 and r.model.pretrained == "/x/y"
    assert r.grpo.estimator == "grpo" and r.optimizer.betas == (0.9, 0.95) and r.checkpoint.export_hf is False
    assert isinstance(r.grpo.temperature, float)


def test_override_creates_missing_table():
    r = load_recipe("tiny_sft", ["grpo.group_size=3"])
    assert r.grpo.group_size == 3


@pytest.mark.parametrize(
    "override, message",
    [
        ("grpo.eps_hihg=0.3", "grpo.eps_hihg"),
        ("nosuch.key=1", "nosuch"),
        ("grpo.group_size=two", "grpo.group_size: expected an integer"),
        ("grpo.group_size=1.5", "grpo.group_size: expected an integer"),
        ("grpo.estimator=ppo", "grpo.estimator: 'ppo' is not one of"),
        ("checkpoint.export_hf=1", "checkpoint.export_hf: expected true or false"),
        ("grpo.top_p=1.5", "grpo: top_p must lie in (0, 1]"),
        ("grpo.mini_batch_prompts=100", "mini_batch_prompts 100 must divide batch_prompts 256"),
        ("grpo.group_size=1", "group_size must be >= 2"),
        ("optimizer.lr=0", "optimizer: lr must be > 0"),
        ("optimizer.betas=[0.9]", "optimizer.betas: expected 2 values"),
        ("parallel.tp=3", "!= job.world_size(64)"),
        ("parallel.tp=0", "parallel.tp must be >= 1"),
        ("parallel.activation_checkpoint=some", "parallel.activation_checkpoint"),
        ("model.preset=qwen4", "model: preset must be one of"),
        ("grpo=3", "is a table"),
        ("grpo.eps_high", "expected key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ValueError) as error:
        load_recipe("grpo_8b", [override])
    assert message in str(error.value)


def test_ep_needs_moe():
    with pytest.raises(ValueError, match="parallel.ep: expert parallelism needs an MoE preset"):
        load_recipe("grpo_8b", ["parallel.ep=8"])


def test_expert_parallel_beside_tensor_parallel_is_refused_and_router_losses_need_moe():
    with pytest.raises(ValueError, match="parallel.ep: ep=8 with tp=4 needs sequence parallelism"):
        load_recipe("grpo_30b_moe", ["parallel.tp=4", "parallel.dp_shard=16"])
    with pytest.raises(ValueError, match="moe.aux_loss_coef: router losses need an MoE preset"):
        load_recipe("grpo_8b", ["moe.aux_loss_coef=0.01"])
    with pytest.raises(ValueError, match="moe: z_loss_coef must be >= 0"):
        load_recipe("grpo_30b_moe", ["moe.z_loss_coef=-1"])


def test_sft_batch_must_split_over_data_parallel_ranks():
    with pytest.raises(ValueError, match="sft.global_batch 100 must be a multiple of the data-parallel size 256"):
        load_recipe("sft_8b", ["sft.global_batch=100"])


def test_unknown_top_level_and_nested_keys_in_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[job]\nname = "x"\nstaeg = "sft"\n')
    with pytest.raises(ValueError, match=r"unknown key\(s\) job.staeg"):
        load_recipe(bad)
    bad.write_text('[jobs]\nname = "x"\n')
    with pytest.raises(ValueError, match=r"unknown key\(s\) jobs"):
        load_recipe(bad)
    bad.write_text('[job\nname = "x"\n')
    with pytest.raises(ValueError, match="not valid TOML"):
        load_recipe(bad)
    bad.write_text("job = 3\n")
    with pytest.raises(ValueError, match="job: expected a table"):
        load_recipe(bad)


def test_resolve_recipe_path(tmp_path):
    assert resolve_recipe_path("grpo_8b") == RECIPES_DIR / "grpo_8b.toml"
    with pytest.raises(
        ValueError, match="unknown recipe 'grpo_9b' \\(did you mean grpo_8b or grpo_32b\\?\\); known: grpo_30b_moe"
    ):
        resolve_recipe_path("grpo_9b")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_recipe_path(tmp_path / "missing.toml")


def test_parse_override_keeps_strings_verbatim():
    assert parse_override("job.name=007") == ("job.name", "007")
    assert parse_override("job.seed=007".replace("007", "7")) == ("job.seed", 7)
    assert parse_override("rollout.sglang_urls=['http://a', 'http://b']") == (
        "rollout.sglang_urls",
        ["http://a", "http://b"],
    )


def test_apply_overrides_does_not_mutate_input():
    raw = {"grpo": {"group_size": 8}}
    out = apply_overrides(raw, ["grpo.group_size=4"])
    assert raw == {"grpo": {"group_size": 8}} and out == {"grpo": {"group_size": 4}}


def test_build_component_directly():
    g = build(GRPOConfig, {"group_size": 4, "batch_prompts": 8, "mini_batch_prompts": 4}, "grpo")
    assert (g.group_size, g.batch_prompts, g.mini_batch_prompts) == (4, 8, 4)


def test_recipe_to_dict_round_trips():
    r = load_recipe("grpo_30b_moe")
    assert build(Recipe, recipe_to_dict(r)) == r
