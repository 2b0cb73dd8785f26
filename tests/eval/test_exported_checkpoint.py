"""osvl.eval on a checkpoint the training stage exported prompts it exactly as the stage did.

The demo's mismatch: ``make demo`` trains tiny_grpo with no system prompt and no tool schema shown,
and ``python -m osvl.eval --checkpoint runs/tiny_grpo/hf ...`` prompted the policy with its own agent
prompt and the paper schema (0/16 against the demo evaluation's ~0.09). Here a tiny policy is
exported by ``finish_stage`` (as the stages do) and the prompt ids ``osvl.eval`` builds for the
held-out questions, images included, are compared with the ids the stage's renderer produces.
"""

from __future__ import annotations

import json

import pytest
import torch

from osvl.config import load_recipe
from osvl.eval.__main__ import (
    build_answerer,
    build_parser,
    main,
    read_model_dir,
    resolve_tool_profile,
    tool_environment,
)
from osvl.eval.benchmarks import load_benchmark
from osvl.eval.items import to_prompt
from osvl.model import from_pretrained
from osvl.trainer.checkpoint import finish_stage
from osvl.trainer.grpo_data import load_prompts
from osvl.trainer.policy import build_policy, policy_arch, policy_image_config, policy_renderer

N = 3


def export(tmp_path, tokenizer, held_out, world_dir, profile, system_prompt):
    """A tiny tiny_grpo policy through the stage's own end (``finish_stage``): ``run/hf``."""
    tokenizer.save(tmp_path / "tokenizer.json")
    prompt_file = ""
    if system_prompt:
        prompt_file = tmp_path / "system.txt"
        prompt_file.write_text(system_prompt)
    recipe = load_recipe(
        "tiny_grpo",
        [
            f"data.tokenizer={tmp_path / 'tokenizer.json'}",
            f"data.train_path={held_out}",
            "model.pretrained=",
            f"data.system_prompt={prompt_file}",
            f"tools.profile={profile}",
            f"tools.world_dir={world_dir}",
            f"job.run_dir={tmp_path / 'run'}",
            "grpo.temperature=0.6",
            "grpo.top_p=0.95",
        ],
    )
    arch = policy_arch(recipe, tokenizer.vocab_size, tokenizer.special)
    model = build_policy(recipe, arch, world_size=1)
    finish_stage(
        lambda step: None, 12, 12, 12, recipe, model, tokenizer, policy_image_config(recipe, arch), tmp_path / "run"
    )
    return recipe, arch, model, tmp_path / "run" / "hf"


def eval_prompt_ids(hf, held_out, world_dir, out, *flags):
    args = build_parser().parse_args(
        [
            "--checkpoint",
            str(hf),
            "--bench",
            f"osvl={held_out}",
            "--mode",
            "agentic",
            "--out",
            str(out),
            "--world",
            str(world_dir),
            *flags,
        ]
    )
    model_dir = read_model_dir(args)
    args.tool_profile = resolve_tool_profile(args.tool_profile, model_dir, args.python_interpreter)
    items = load_benchmark(held_out, "osvl").items[:N]
    with tool_environment(args) as env:
        renderer = build_answerer(args, None, model_dir, env).renderer
        return [renderer.render_prompt(to_prompt(item)).ids for item in items], args.tool_profile


@pytest.mark.parametrize(
    "profile, system_prompt",
    [("paper", ""), ("release", "Answer inside <response>.")],
    ids=["demo_paper_no_prompt", "release_with_prompt"],
)
def test_eval_prompts_the_exported_policy_as_its_stage_did(
    tokenizer, held_out, world_dir, tmp_path, profile, system_prompt
):
    recipe, arch, model, hf = export(tmp_path, tokenizer, held_out, world_dir, profile, system_prompt)
    stage = policy_renderer(recipe, tokenizer, arch)
    prompts = load_prompts(recipe.data)[:N]  # the GRPO stage's own reader
    assert any(p.images for p in prompts)
    trained = [stage.render_prompt(p).ids for p in prompts]

    ids, inferred_profile = eval_prompt_ids(hf, held_out, world_dir, tmp_path / "eval")
    assert ids == trained and inferred_profile == profile

    # the mechanism of the demo's 0/16: the same weights without the template get the shipped prompt
    (hf / "tokenizer_config.json").unlink()
    (hf / "chat_template.jinja").unlink()
    stale, _ = eval_prompt_ids(hf, held_out, world_dir, tmp_path / "eval_stale", "--tool-profile", profile)
    assert all(a != b for a, b in zip(stale, trained, strict=True))


def test_the_export_is_a_whole_model_directory(tokenizer, held_out, world_dir, tmp_path):
    recipe, _, model, hf = export(tmp_path, tokenizer, held_out, world_dir, "release", "Be brief.")
    assert {p.name for p in hf.iterdir()} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
    }
    s = tokenizer.special
    generation = json.loads((hf / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [s.im_end, s.endoftext] and generation["pad_token_id"] == s.endoftext
    assert (generation["temperature"], generation["top_p"], generation["do_sample"]) == (0.6, 0.95, True)
    assert "top_k" not in generation
    config = json.loads((hf / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (hf / "chat_template.jinja").read_text()
    assert config["eos_token"] == "<|im_end|>" and config["model_max_length"] == model.arch.text.max_position_embeddings
    video = json.loads((hf / "video_preprocessor_config.json").read_text())
    image = json.loads((hf / "preprocessor_config.json").read_text())
    assert {k: video[k] for k in ("patch_size", "temporal_patch_size", "merge_size")} == {
        k: image[k] for k in ("patch_size", "temporal_patch_size", "merge_size")
    }
    assert recipe.checkpoint.export_dtype == "float32"
    loaded = from_pretrained(hf, dtype=torch.float32).state_dict()
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded[key], tensor), key


def test_cli_runs_the_export_with_its_own_prompt(tokenizer, held_out, world_dir, tmp_path, capsys):
    *_, hf = export(tmp_path, tokenizer, held_out, world_dir, "release", "Be brief.")
    argv = [
        "--checkpoint",
        str(hf),
        "--bench",
        f"osvl={held_out}",
        "--mode",
        "agentic",
        "--out",
        str(tmp_path / "o"),
        "--world",
        str(world_dir),
        "--limit",
        "2",
        "--max-new-tokens",
        "4",
        "--max-turns",
        "1",
        "--dtype",
        "float32",
    ]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["tool_profile"] == "release" and summary["system_prompt_source"] == "checkpoint"
    assert "web_search" in summary["system_tools"] and summary["system_turn_sha256"]
    (tmp_path / "none.txt").write_text("")
    assert main([*argv[:7], str(tmp_path / "o2"), *argv[8:], "--system-prompt", str(tmp_path / "none.txt")]) == 0
    summary = json.loads((tmp_path / "o2" / "summary.json").read_text())
    assert summary["system_prompt_source"] == "file" and "web_search" in summary["system_tools"]
    capsys.readouterr()
