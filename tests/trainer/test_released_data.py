"""The released SearchVL artifacts straight into the trainer: a ShareGPT SFT file, a verl-parquet
RL file under the release tool profile, a released-style HF directory as ``model.pretrained``,
and the recipe keys that select them. Every fixture is written here by hand (no downloads)."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from osvl.config import load_recipe
from osvl.config.recipe import DataConfig, ToolsConfig
from osvl.data.chat import ChatRenderer
from osvl.data.formats import FileStats, checkpoint_image_config, detect_format
from osvl.data.image import ImageConfig
from osvl.data.tokenizer import load_tokenizer
from osvl.model import read_hf_tensors, save_pretrained
from osvl.rl.trajectory import ToolStatus
from osvl.rollout import LocalEngine, ReplayEngine, RolloutRecorder
from osvl.tools import ToolEnvironment
from osvl.tools.profiles import ProfiledEnvironment, tool_profile
from osvl.trainer import read_metrics, run_grpo, run_sft
from osvl.trainer.grpo_data import load_prompts
from osvl.trainer.policy import build_policy, policy_arch, policy_image_config, policy_renderer
from osvl.trainer.sft_data import load_sft_sequences, read_system_prompt
from osvl.trainer.tool_env import profile_environment, with_faults
from osvl.world.__main__ import main as world_main
from tests.interop.fixtures import (
    SYSTEM,
    function_call_record,
    png_bytes,
    release_record,
    rgb,
    write_png,
)
from tests.trainer.fixtures import write_sft_data

OWN_PROMPT = "You answer questions about bridges. Think before every tool call."
QUIET = ["metrics.console=false", "metrics.tensorboard=false", "checkpoint.every_steps=0"]


def write_sharegpt(directory: Path, image_dir: Path) -> Path:
    """Four usable trajectories (tool images, function_call turns, one without a system prompt)
    and one whose image is missing, as a LLaMA-Factory JSON array."""
    for i in range(3):
        write_png(image_dir / f"q{i}.png", rgb(40, 48, seed=i))
        write_png(image_dir / f"c{i}.png", rgb(16, 16, seed=10 + i))
    no_system = dict(release_record("q2.png", "c2.png"), system="")
    missing = release_record("q0.png", "gone.png")
    records = [
        release_record("q0.png", "c0.png"),
        function_call_record(),
        release_record("q1.png", "c1.png"),
        no_system,
        missing,
    ]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "searchvl_sft.json"
    path.write_text(json.dumps(records, indent=1))
    return path


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    root = tmp_path_factory.mktemp("released")
    tok, _ = write_sft_data(root / "tok")
    sharegpt = write_sharegpt(root / "sft", root / "sft")  # images next to the file: the reader's default root
    prompt_file = root / "system.txt"
    prompt_file.write_text(OWN_PROMPT + "\n")
    return root, tok, sharegpt, prompt_file


def renderer_for(tok: Path) -> ChatRenderer:
    return ChatRenderer(load_tokenizer(tok), ImageConfig(patch_size=8, min_pixels=1024, max_pixels=16384))


# --- recipe keys -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.format=llama_factory"], "data.format: 'llama_factory' is not one of"),
        (["data.format=verl_parquet"], "the sft stage reads"),
        (["data.format=osvl", "data.image_root=/images"], "image_root applies to the sharegpt format only"),
        (["tools.profile=openai"], "tools.profile: 'openai' is not one of"),
        (["tools.python_interpreter=1"], "tools.python_interpreter: expected true or false"),
    ],
)
def test_new_recipe_keys_reject_bad_values(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_recipe("tiny_sft", overrides)


def test_new_recipe_keys_validate_in_typed_configs():
    with pytest.raises(ValueError, match="the grpo stage reads"):
        load_recipe("tiny_grpo", ["data.format=sharegpt"])
    with pytest.raises(ValueError, match="format must be one of"):
        DataConfig(format="csv")
    with pytest.raises(ValueError, match="profile must be one of"):
        ToolsConfig(profile="gpt")
    recipe = load_recipe(
        "tiny_sft",
        [
            "data.format=sharegpt",
            "data.image_root=/data/images",
            "data.system_prompt=prompts/system.txt",
            "tools.profile=release",
        ],
    )
    assert (recipe.data.format, recipe.data.image_root, recipe.data.system_prompt, recipe.tools.profile) == (
        "sharegpt",
        "/data/images",
        "prompts/system.txt",
        "release",
    )
    assert load_recipe("tiny_grpo", ["data.format=verl_parquet"]).data.format == "verl_parquet"
    assert load_recipe("tiny_sft").data.format == "auto" and not load_recipe("tiny_sft").tools.python_interpreter


def test_system_prompt_file_is_read_or_refused(tmp_path):
    assert read_system_prompt("") == ""
    with pytest.raises(ValueError, match="data.system_prompt file not found: .*none.txt"):
        read_system_prompt(str(tmp_path / "none.txt"))
    (tmp_path / "blank.txt").write_text("  \n")
    with pytest.raises(ValueError, match="data.system_prompt file .*blank.txt is empty"):
        read_system_prompt(str(tmp_path / "blank.txt"))


# --- SFT on ShareGPT ---------------------------------------------------------------------------


def test_formats_are_detected(released, tmp_path):
    root, _, sharegpt, _ = released
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "a"}]), tmp_path / "rl.bin")
    jsonl = tmp_path / "one.jsonl"
    jsonl.write_text(json.dumps(function_call_record()) + "\n")
    assert detect_format(sharegpt) == "sharegpt" and detect_format(jsonl) == "sharegpt"
    assert detect_format(tmp_path / "rl.bin") == "verl_parquet"  # by magic bytes, not the suffix
    assert detect_format(write_sft_data(root / "tok")[1]) == "osvl"
    with pytest.raises(ValueError, match="does not exist"):
        detect_format(tmp_path / "none.json")


def test_sharegpt_sequences_keep_each_records_system_and_tools(released, caplog):
    _, tok, sharegpt, prompt_file = released
    renderer = renderer_for(tok)
    stats = FileStats(str(sharegpt))
    data = DataConfig(train_path=str(sharegpt), format="sharegpt", system_prompt=str(prompt_file))
    with caplog.at_level(logging.INFO, logger="osvl.trainer.sft_data"):
        sequences = load_sft_sequences(data, renderer, stats)
    assert len(sequences) == 4 and stats.records == 4
    assert '"records": 4' in caplog.text and "skipped 1 record(s)" in caplog.text  # logged, not fatal
    assert dict(stats.rejected) == {"missing image": 1} and "gone.png" in stats.examples["missing image"]
    assert stats.tool_calls == 2 + 2 + 2 + 2 and stats.images == 2 * 3
    texts = [renderer.tokenizer.decode(s.input_ids.tolist()) for s in sequences]
    for text in texts[:3]:
        assert text.startswith(f"<|im_start|>system\n{SYSTEM}") and '"name": "crop"' in text
        assert OWN_PROMPT not in text
    assert texts[3].startswith(f"<|im_start|>system\n{OWN_PROMPT}")  # the record had none: the recipe's file
    pads = renderer.tokenizer.special.image_pad
    first = sequences[0]
    assert int((first.input_ids == pads).sum()) == sum(p.num_tokens for p in first.images) and len(first.images) == 2
    assert first.loss_mask.any() and not first.loss_mask[first.input_ids == pads].any()


def test_sharegpt_image_root_is_honoured(released, tmp_path):
    _, tok, _, _ = released
    path = write_sharegpt(tmp_path / "data", tmp_path / "pictures")
    stats = FileStats(str(path))
    only_text = load_sft_sequences(DataConfig(train_path=str(path), format="sharegpt"), renderer_for(tok), stats)
    assert len(only_text) == 1 and dict(stats.rejected) == {"missing image": 4}  # looked next to the file
    data = DataConfig(train_path=str(path), format="sharegpt", image_root=str(tmp_path / "pictures"))
    assert len(load_sft_sequences(data, renderer_for(tok))) == 4


def test_a_file_with_nothing_usable_is_a_clear_error(released, tmp_path):
    _, tok, _, _ = released
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(release_record("q0.png", "c0.png")) + "\n")
    with pytest.raises(ValueError, match="holds no usable trajectories .*missing image"):
        load_sft_sequences(DataConfig(train_path=str(path), format="sharegpt"), renderer_for(tok))


def test_stage_refuses_the_other_stages_data(released, tmp_path):
    _, tok, sharegpt, _ = released
    with pytest.raises(ValueError, match="is sharegpt data, which the grpo stage does not read"):
        load_prompts(DataConfig(train_path=str(sharegpt)))
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "a"}]), tmp_path / "rl.parquet")
    with pytest.raises(ValueError, match="is verl_parquet data, which the sft stage does not read"):
        load_sft_sequences(str(tmp_path / "rl.parquet"), renderer_for(tok))


def changed_keys(initial: dict, trained: dict) -> set[str]:
    assert trained.keys() == initial.keys()
    return {k for k in trained if not torch.equal(trained[k], initial[k])}


def test_sft_stage_trains_on_sharegpt(released, tmp_path):
    _, tok, sharegpt, _ = released
    recipe = load_recipe(
        "tiny_sft",
        [
            f"data.tokenizer={tok}",
            f"data.train_path={sharegpt}",
            f"job.run_dir={tmp_path / 'run'}",
            "sft.global_batch=4",
            "sft.max_steps=1",
            "scheduler.warmup_ratio=0.0",
            *QUIET,
        ],
    )
    result = run_sft(recipe)
    assert result.steps == 1 and math.isfinite(result.final_loss) and result.final_loss > 0
    assert all(math.isfinite(m["loss"]) for m in read_metrics(tmp_path / "run"))
    tokenizer = load_tokenizer(tok)
    initial_model = build_policy(recipe, policy_arch(recipe, tokenizer.vocab_size, tokenizer.special), 1)
    save_pretrained(initial_model, tmp_path / "init", dtype=torch.float32)
    initial = read_hf_tensors(tmp_path / "init")
    changed = changed_keys(initial, read_hf_tensors(tmp_path / "run" / "hf"))
    assert any(k.startswith("model.language_model") for k in changed)
    assert any(k.startswith("model.visual") for k in changed)  # the fixture's images reached the tower


# --- a released-style HF directory as model.pretrained ------------------------------------------


def write_released_dir(root: Path, tok: Path, preprocessor: dict) -> Path:
    base = load_recipe("tiny_sft", [f"data.tokenizer={tok}"])
    tokenizer = load_tokenizer(tok)
    model = build_policy(base, policy_arch(base, tokenizer.vocab_size, tokenizer.special), 1)
    save_pretrained(model, root, dtype=torch.float32)
    tokenizer.save(root / "tokenizer.json")
    (root / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return root


PREPROCESSOR = {
    "patch_size": 8,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 2048, "longest_edge": 12288},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def test_released_dir_supplies_tokenizer_and_image_processor(released, tmp_path):
    _, tok, sharegpt, _ = released
    checkpoint = write_released_dir(tmp_path / "OpenSearch-VL-tiny", tok, PREPROCESSOR)
    recipe = load_recipe(
        "tiny_sft",
        [
            f"model.pretrained={checkpoint}",
            "data.tokenizer=",
            f"data.train_path={sharegpt}",
            f"job.run_dir={tmp_path / 'run'}",
            "sft.global_batch=2",
            "sft.max_steps=1",
            "scheduler.warmup_ratio=0.0",
            *QUIET,
        ],
    )
    assert recipe.data.tokenizer == "" and (recipe.data.min_pixels, recipe.data.max_pixels) == (1024, 16384)
    tokenizer = load_tokenizer(recipe.data.tokenizer or recipe.model.pretrained)
    arch = policy_arch(recipe, tokenizer.vocab_size, tokenizer.special)
    shipped = policy_image_config(recipe, arch)
    assert (shipped.patch_size, shipped.min_pixels, shipped.max_pixels) == (8, 2048, 12288)
    assert policy_renderer(recipe, tokenizer, arch).image_config == shipped
    with_own_tokenizer = load_recipe("tiny_sft", [f"model.pretrained={checkpoint}", f"data.tokenizer={tok}"])
    assert policy_image_config(with_own_tokenizer, arch).min_pixels == 1024  # the recipe's budget

    result = run_sft(recipe)
    assert result.steps == 1 and math.isfinite(result.final_loss)
    changed = changed_keys(read_hf_tensors(checkpoint), read_hf_tensors(tmp_path / "run" / "hf"))
    assert any(k.startswith("model.language_model") for k in changed)


def test_released_dir_with_a_foreign_image_processor_is_refused(released, tmp_path):
    _, tok, _, _ = released
    checkpoint = write_released_dir(tmp_path / "ckpt", tok, dict(PREPROCESSOR, patch_size=16))
    recipe = load_recipe("tiny_sft", [f"model.pretrained={checkpoint}", "data.tokenizer="])
    tokenizer = load_tokenizer(checkpoint)
    arch = policy_arch(recipe, tokenizer.vocab_size, tokenizer.special)
    with pytest.raises(ValueError, match=r"patches images as .* = \(16, 2, 2\) .* expects \(8, 2, 2\)"):
        policy_image_config(recipe, arch)
    (checkpoint / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="preprocessor_config.json is not valid JSON"):
        checkpoint_image_config(checkpoint)
    (checkpoint / "preprocessor_config.json").unlink()
    assert checkpoint_image_config(checkpoint) is None
    assert policy_image_config(recipe, arch).min_pixels == recipe.data.min_pixels


# --- GRPO on verl parquet with the release tool profile ------------------------------------------

WORDS = ["amber", "birch", "cobalt"]


def write_verl_parquet(path: Path) -> Path:
    rows = [
        {
            "data_source": "searchvl",
            "prompt": [{"role": "user", "content": f"<image>The code word is {word}. What is it?"}],
            "images": [{"bytes": png_bytes(rgb(40, 48, seed=i)), "path": f"{i}.png"}],
            "reward_model": {"style": "rule", "ground_truth": [word]},
            "extra_info": {"index": f"rl{i}"},
        }
        for i, word in enumerate(WORDS[:2])
    ]
    rows.append(dict(rows[0], reward_model={"style": "rule", "ground_truth": None}))  # rejected: no answer
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


RELEASE_CALLS = [
    '{"name": "web_search", "arguments": {"q": "country population"}}',
    '{"name": "crop", "arguments": {"image": "img_1", "x": 0, "y": 0, "width": 16, "height": 16}}',
    '{"name": "zoom_in", "arguments": {"image": "img_1"}}',
]


def release_policy(local: LocalEngine) -> ReplayEngine:
    """Turn 0: one release-protocol call chosen by the sample's seed; turn 1: an answer, right or wrong."""
    tok = local.tokenizer

    def script(request):
        text = tok.decode(request.input_ids, skip_special_tokens=False)
        word = re.search(r"code word is (\w+)", text).group(1)
        seed = request.sampling.seed
        if (
            text.count("<|im_start|>assistant") <= 1
        ):  # the first turn (the release schema's prompt mentions </tool_call>)
            call = RELEASE_CALLS[seed % 3]
            out = f"<think>check</think>\n<tool_call>\n{call}\n</tool_call>"
        else:
            out = f"<think>done</think>\n<response>{word if seed % 2 else 'wrong'}</response>"
        return tok.encode(out) + [tok.special.im_end]

    return ReplayEngine(local, script)


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    assert world_main(["build", "--out", str(root), "--seed", "0"]) == 0
    return root


def test_grpo_stage_runs_verl_parquet_with_release_tools(released, world_dir, tmp_path):
    _, tok, _, _ = released
    parquet = write_verl_parquet(tmp_path / "searchvl_rl.parquet")
    stats = FileStats(str(parquet))
    assert [p.id for p in load_prompts(DataConfig(train_path=str(parquet), format="verl_parquet"), stats)] == [
        "rl0",
        "rl1",
    ]
    assert dict(stats.rejected) == {"no answer": 1}
    run = tmp_path / "run"
    recipe = load_recipe(
        "tiny_grpo",
        [
            f"data.tokenizer={tok}",
            f"data.train_path={parquet}",
            f"job.run_dir={run}",
            "model.pretrained=",
            f"tools.world_dir={world_dir}",
            "tools.profile=release",
            "tools.fault_rate=0.0",
            "tools.workers=1",
            "grpo.max_steps=1",
            "grpo.batch_prompts=2",
            "grpo.mini_batch_prompts=2",
            "grpo.group_size=4",
            "grpo.max_response_tokens=96",
            "grpo.max_prompt_tokens=4096",
            "rollout.max_turns=3",
            *QUIET,
        ],
    )
    result = run_grpo(recipe, engine_wrapper=release_policy)
    assert result.steps == 1 and math.isfinite(result.final_loss)

    trajectories = RolloutRecorder(run / "rollouts").read(1)
    assert len(trajectories) == 8 and {t.prompt.id for t in trajectories} == {"rl0", "rl1"}
    results: dict[str, list] = {}
    for t in trajectories:
        results.setdefault(t.steps[0].tool_call.name, []).append(t.steps[0].tool_result)
    assert set(results) == {"web_search", "crop", "zoom_in"}  # release names, as the policy wrote them
    for search in results["web_search"]:
        assert (search.status, search.tool) == (ToolStatus.OK, "text_search") and search.text, search.error
    for crop in results["crop"]:
        assert (crop.status, crop.tool) == (ToolStatus.OK, "crop") and "New image ID: img_2." in crop.text
    for unknown in results["zoom_in"]:
        assert unknown.status is ToolStatus.PARSE_ERROR and "unknown tool 'zoom_in'" in unknown.error

    metrics = read_metrics(run)[0]
    assert math.isfinite(metrics["loss"]) and 0 < metrics["accuracy"] < 1
    initial = read_hf_tensors(write_initial(recipe, tok, tmp_path / "init"))
    assert any(k.startswith("model.language_model") for k in changed_keys(initial, read_hf_tensors(run / "hf")))


def write_initial(recipe, tok: Path, path: Path) -> Path:
    tokenizer = load_tokenizer(tok)
    model = build_policy(recipe, policy_arch(recipe, tokenizer.vocab_size, tokenizer.special), 1)
    save_pretrained(model, path, dtype=torch.float32)
    return path


def test_release_renderer_shows_the_release_schema(released):
    _, tok, _, prompt_file = released
    tokenizer = load_tokenizer(tok)
    recipe = load_recipe(
        "tiny_grpo",
        [f"data.tokenizer={tok}", "model.pretrained=", "tools.profile=release", f"data.system_prompt={prompt_file}"],
    )
    arch = policy_arch(recipe, tokenizer.vocab_size, tokenizer.special)
    system = policy_renderer(recipe, tokenizer, arch).system
    assert system.startswith(f"<|im_start|>system\n{OWN_PROMPT}\n\n")
    names = re.findall(r'"name": "(\w+)"', system)
    assert names == [t["function"]["name"] for t in tool_profile("release").tool_schemas()]
    assert {"web_search", "layout_parsing", "visit"} <= set(names) and "ocr" not in names
    assert "python_interpreter" not in names  # off unless tools.python_interpreter = true
    with_python = load_recipe(
        "tiny_grpo",
        [f"data.tokenizer={tok}", "model.pretrained=", "tools.profile=release", "tools.python_interpreter=true"],
    )
    assert '"name": "python_interpreter"' in policy_renderer(with_python, tokenizer, arch).system
    paper = load_recipe(
        "tiny_grpo", [f"data.tokenizer={tok}", "model.pretrained=", f"data.system_prompt={prompt_file}"]
    )
    assert policy_renderer(paper, tokenizer, arch).system == f"<|im_start|>system\n{OWN_PROMPT}<|im_end|>\n"


def test_faults_keep_the_profile():
    recipe = load_recipe("tiny_grpo", ["tools.profile=release", "tools.fault_rate=0.5"])
    env = ProfiledEnvironment(tool_profile("release"), pool=None)
    faulty = with_faults(env, recipe, rank=0)
    assert isinstance(faulty, ProfiledEnvironment) and faulty.profile is env.profile and faulty.pool is not None
    paper = with_faults(profile_environment(tool_profile("paper"), None), recipe, rank=0)
    assert type(paper) is ToolEnvironment and "visit" in paper.registry
    assert type(profile_environment(tool_profile("release"), None)) is ProfiledEnvironment
