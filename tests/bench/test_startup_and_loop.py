"""bench/startup.py and bench/train_loop.py end to end on CPU (tiny shapes), and the loop's GPU-sized
recipes as the device check will build them."""

from __future__ import annotations

import json

import pytest

import bench.startup as startup
from bench.train_loop import parse_args, recipes, write_data


@pytest.mark.slow
def test_startup_bench_records_both_start_ups(tmp_path):
    assert startup.main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    [path] = tmp_path.glob("startup-cpu-*.json")
    record = json.loads(path.read_text())
    runs = {(r["world"], r["mode"]): r for r in record["runs"]}
    assert set(runs) == {(2, "sharded"), (2, "whole")}
    sharded, whole = runs[2, "sharded"], runs[2, "whole"]
    assert sharded["shard_bytes"] == whole["shard_bytes"] > 0
    assert sharded["growth_max_bytes"] < whole["growth_max_bytes"]  # the whole model, twice, on every rank
    assert record["git"]["short"] and record["checkpoint"]["params"] > 0


def test_the_device_loop_builds_a_released_width_with_the_tokenizer_ids(tmp_path):
    from osvl.data.tokenizer import load_tokenizer
    from osvl.trainer.policy import policy_arch

    config, _ = parse_args([])
    assert (config.preset, config.layers, config.param_dtype) == ("qwen3_vl_8b", 2, "bfloat16")
    data = write_data(tmp_path / "data", config.vocab)
    sft, grpo = recipes(config, data, tmp_path)
    tokenizer = load_tokenizer(data["tokenizer"])
    arch = policy_arch(sft, tokenizer.vocab_size, tokenizer.special)
    assert (arch.text.hidden_size, arch.text.vocab_size, arch.text.num_hidden_layers) == (4096, 151936, 2)
    assert arch.image_token_id == tokenizer.special.image_pad and arch.vision.deepstack_visual_indexes == (8, 16)
    assert grpo.model.pretrained == str(tmp_path / "sft" / "hf") and grpo.rollout.engine == "local"
    assert sft.checkpoint.export_dtype == grpo.parallel.param_dtype == "bfloat16"


@pytest.mark.slow
def test_the_device_loop_runs_without_opencv(tmp_path):
    """A GPU image may have no OpenCV: the loop (text tools, no images) must not import it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "cv2.py").write_text('raise ImportError("no OpenCV on this machine")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(repo), str(repo / "kernels")])}
    run = subprocess.run(
        [sys.executable, "bench/train_loop.py", "--smoke", "--out-dir", str(tmp_path / "out")],
        cwd=repo,
        env={**env, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    [path] = (tmp_path / "out").glob("train_loop-*.json")
    assert json.loads(path.read_text())["summary"]["grpo_tool_calls_mean"] >= 1
