"""bench/train_step.py's pieces: the truncated architecture, the synthetic multimodal batch, its
arguments, the record written as the steps go. (The whole step runs in tests/bench/test_device_check.py's
smoke run.)"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

import bench.train_step as train_step
from bench.train_step import architecture, main, parse_args, step_summary, synthetic_batch


def test_released_width_cut_to_four_layers_keeps_the_vocabulary_and_vision_tower():
    config, _ = parse_args(["--preset", "qwen3_vl_8b", "--layers", "4"])
    arch, special = architecture(config)
    assert (arch.text.hidden_size, arch.text.vocab_size, arch.text.num_hidden_layers) == (4096, 151936, 4)
    assert arch.vision.depth == 27 and arch.vision.deepstack_visual_indexes == (8, 16, 24)
    assert arch.image_token_id == special.image_pad == 151655
    two, _ = architecture(parse_args(["--preset", "qwen3_vl_8b", "--layers", "2"])[0])
    assert two.vision.deepstack_visual_indexes == (8, 16)  # one injection per remaining decoder layer


def test_synthetic_batch_packs_images_and_policy_tokens():
    config, _ = parse_args(["--smoke", "--tokens", "600", "--seqs", "3", "--images-per-seq", "2", "--image-side", "64"])
    arch, special = architecture(config)
    batch = synthetic_batch(config, arch, special)
    assert batch.num_tokens == 600 and batch.num_seqs == 3
    assert batch.cu_seqlens.tolist() == [0, 200, 400, 600]
    merge = arch.vision.spatial_merge_size**2
    assert int((batch.input_ids == special.image_pad).sum()) == batch.pixel_values.shape[0] // merge
    assert batch.image_grid_thw.shape == (6, 3)
    assert 0 < batch.num_valid_tokens < 600 and batch.old_logprobs[batch.loss_mask].lt(0).all()
    assert batch.position_ids.shape == (3, 600)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--smoke", "--steps", "1"], "--steps >= 2"),
        (["--smoke", "--layers", "0"], "--layers >= 1"),
        (["--smoke", "--tokens", "40", "--seqs", "4", "--image-side", "64"], "cannot hold"),
    ],
)
def test_bad_arguments(argv, message, tmp_path, capsys):
    if message == "cannot hold":
        config, _ = parse_args(argv)
        arch, special = architecture(config)
        with pytest.raises(ValueError, match=message):
            synthetic_batch(config, arch, special)
        return
    with pytest.raises(ValueError, match=message):
        parse_args(argv)
    assert main([*argv, "--out-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU defaults")
def test_cpu_smoke_defaults():
    config, _ = parse_args(["--smoke"])
    assert (config.preset, config.param_dtype, config.attn_backend, config.tokens) == ("tiny", "float32", "sdpa", 512)


def test_record_is_written_before_the_steps_and_after_each(tmp_path, monkeypatch):
    """A step killed mid-run (here the second one raises) leaves the record of the steps before it."""
    marks = 0
    real_mark = train_step.Clock.mark

    def mark_until_second_step(self):
        nonlocal marks
        marks += 1
        if marks > 5:  # five marks per step: the second step's first one
            raise RuntimeError("killed in step 1")
        return real_mark(self)

    monkeypatch.setattr(train_step.Clock, "mark", mark_until_second_step)
    config, _ = parse_args(["--smoke", "--steps", "3", "--tokens", "256"])
    try:
        with pytest.raises(RuntimeError, match="killed in step 1"):
            train_step.run(config, tmp_path, "partial", 0.0)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    [path] = tmp_path.glob("partial-cpu-*.json")
    record = json.loads(path.read_text())
    assert record["complete"] is False and [s["step"] for s in record["steps"]] == [0]
    assert record["summary"]["step_s"] is None  # the warm-up step alone times nothing
    assert record["git"]["commit"] and record["batch"]["tokens"] == 256


def test_step_summary_takes_medians_after_the_warm_up():
    steps = [
        {"step_s": 9.0, "loss_s": 9.0, "peak_memory_bytes": None},
        {"step_s": 2.0, "loss_s": 0.5, "peak_memory_bytes": None},
        {"step_s": 4.0, "loss_s": 1.5, "peak_memory_bytes": None},
    ]
    summary = step_summary(steps, tokens=300, flops=6e12, peak=None)
    assert summary["step_s"] == 3.0 and summary["tokens_per_s"] == 100.0 and summary["loss_time_share"] == 1 / 3
    assert summary["model_tflops_per_s"] == 2.0 and summary["mfu"] is None and summary["peak_memory_gib"] is None
    assert set(step_summary(steps[:1], 300, 6e12, None).values()) == {None}
