"""Pure parts of the trainer: the chunked SFT loss against float64, the lr schedule, the SFT data
stream and its cursor, the vision filler, metrics files, and ``--dry-run`` of a paper recipe."""

from __future__ import annotations

import io
import itertools
import json
import math

import pytest
import torch

from osvl.config import load_recipe
from osvl.config.recipe import SchedulerConfig
from osvl.data.chat import ChatRenderer
from osvl.data.formats import tokenize_steps
from osvl.data.image import ImageConfig
from osvl.data.tokenizer import load_tokenizer
from osvl.data.vision_filler import with_vision_filler
from osvl.step import sft_loss
from osvl.train import dry_run, main
from osvl.trainer import MetricsWriter, lr_factor, progress_line, read_metrics
from osvl.trainer.index_stream import IndexStream
from osvl.trainer.sft_data import load_sft_sequences, rank_microbatches
from tests.trainer.fixtures import trajectory, write_sft_data


def _reference(hidden, weight, targets, mask, normalizer):
    logp = torch.log_softmax(hidden.double() @ weight.double().t(), dim=-1)
    return -(logp.gather(1, targets[:, None]).squeeze(1) * mask.double()).sum() / normalizer


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_sft_loss_matches_float64(chunk):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 8, generator=gen, requires_grad=True)
    weight = torch.randn(11, 8, generator=gen, requires_grad=True)
    targets = torch.randint(0, 11, (7,), generator=gen)
    mask = torch.tensor([1, 0, 1, 1, 0, 1, 1], dtype=torch.bool)
    loss = sft_loss(hidden, weight, targets, mask, 5, chunk=chunk)
    loss.backward()
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref = _reference(h64, w64, targets, mask, 5)
    ref.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-6)
    assert hidden.grad[1].abs().sum() == 0  # masked rows get no gradient


def test_sft_loss_bf16_inputs_accumulate_in_fp32():
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(5, 4, generator=gen), torch.randn(9, 4, generator=gen)
    targets, mask = torch.randint(0, 9, (5,), generator=gen), torch.ones(5, dtype=torch.bool)
    loss = sft_loss(hidden.bfloat16(), weight.bfloat16(), targets, mask, 5)
    ref = _reference(hidden.bfloat16().float(), weight.bfloat16().float(), targets, mask, 5)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)


def test_sft_loss_bad_shapes():
    with pytest.raises(ValueError, match="must share D"):
        sft_loss(
            torch.zeros(3, 4), torch.zeros(5, 6), torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.bool), 1
        )
    with pytest.raises(ValueError, match="target_ids and loss_mask must be"):
        sft_loss(
            torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long), torch.ones(3, dtype=torch.bool), 1
        )
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        sft_loss(
            torch.zeros(3, 4),
            torch.zeros(5, 4),
            torch.zeros(3, dtype=torch.long),
            torch.ones(3, dtype=torch.bool),
            1,
            chunk=0,
        )


def test_lr_schedule_warmup_then_cosine():
    config = SchedulerConfig(kind="cosine", warmup_ratio=0.1, min_lr_ratio=0.1)
    factors = [lr_factor(s, 100, config) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0)
    assert factors[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in itertools.pairwise(factors[10:]))
    assert lr_factor(0, 10, SchedulerConfig(kind="constant", warmup_ratio=0.0)) == 1.0
    with pytest.raises(ValueError, match="total_steps must be >= 1"):
        lr_factor(0, 0, config)


def test_stream_is_seeded_and_resumable():
    a = IndexStream(10, 4, seed=3)
    batches = [a.next_batch() for _ in range(5)]
    assert all(len(b) == 4 for b in batches) and a.steps_per_epoch == 2
    assert sorted(batches[0] + batches[1]) == sorted(set(batches[0] + batches[1]))  # no repeats in an epoch
    assert batches[0] != batches[2]  # a new permutation each epoch
    b = IndexStream(10, 4, seed=3)
    b.next_batch(), b.next_batch(), b.next_batch()
    c = IndexStream(10, 4, seed=3)
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))
    assert [c.next_batch() for _ in range(2)] == batches[3:5]
    with pytest.raises(ValueError, match="exceeds the 3 items"):
        IndexStream(3, 4, seed=0)


def test_tokenize_steps_and_microbatches(tmp_path):
    tok_path, data = write_sft_data(tmp_path)
    tokenizer = load_tokenizer(tok_path)
    t = tokenize_steps(trajectory(1, with_image=False), tokenizer)
    assert t.steps[0].token_ids[-1] == tokenizer.special.im_end
    assert tokenizer.decode(t.steps[0].token_ids[:-1]) == t.steps[0].text
    renderer = ChatRenderer(tokenizer, ImageConfig(patch_size=8, min_pixels=1024, max_pixels=16384))
    sequences = load_sft_sequences(data, renderer)
    assert len(sequences) == 8
    per_rank = [rank_microbatches(sequences, [1, 3, 5, 7], 4096, 2, r, renderer) for r in range(2)]
    assert per_rank[0][1] == per_rank[1][1] == sum(sequences[i].num_valid_tokens for i in (1, 3, 5, 7))
    for batches, _, _ in per_rank:  # text-only sequences: every micro-batch carries a filler image
        assert all(b.image_grid_thw.shape[0] == 1 for b in batches)


def test_vision_filler_adds_a_lossless_document(tmp_path):
    tok_path, _ = write_sft_data(tmp_path)
    tokenizer = load_tokenizer(tok_path)
    renderer = ChatRenderer(tokenizer, ImageConfig(patch_size=8, min_pixels=1024, max_pixels=16384))
    from osvl.data.packing import pack_microbatch, train_sequence

    seq = train_sequence(tokenize_steps(trajectory(1, with_image=False), tokenizer), renderer, reward=0.0)
    batch = pack_microbatch([seq], renderer.image_config, tokenizer.special)
    filled = with_vision_filler(batch, renderer.image_config, tokenizer.special)
    assert filled.cu_seqlens.tolist() == batch.cu_seqlens.tolist() + [batch.num_tokens + 3]
    assert filled.loss_mask[batch.num_tokens :].sum() == 0 and filled.loss_mask.sum() == batch.loss_mask.sum()
    assert int((filled.input_ids == tokenizer.special.image_pad).sum()) == 1
    assert filled.pixel_values.shape == (4, 3 * 2 * 8 * 8)
    assert with_vision_filler(filled, renderer.image_config, tokenizer.special) is filled


def test_metrics_jsonl_and_progress_line(tmp_path):
    out = io.StringIO()
    writer = MetricsWriter(
        tmp_path, enabled=True, tensorboard=True, console=True, header={"job": {"name": "x"}}, stream=out
    )
    writer.log(1, 4, {"loss": 2.5, "lr": 1e-3})
    writer.log(2, 4, {"loss": 2.0, "lr": 1e-3})
    writer.close()
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.5, "lr": 1e-3}, {"step": 2, "loss": 2.0, "lr": 1e-3}]
    assert "[##########..........] 2/4 loss=2 lr=0.001" in out.getvalue()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    silent = MetricsWriter(tmp_path / "other", enabled=False, tensorboard=True, console=True)
    silent.log(1, 1, {"loss": 1.0})
    assert not (tmp_path / "other").exists()
    assert progress_line(0, 0, {}) == "[####################] 0/0 "
    with pytest.raises(ValueError, match="has no metrics.jsonl"):
        read_metrics(tmp_path / "other")


def test_dry_run_plans_grpo_30b_moe():
    lines = dry_run(load_recipe("grpo_30b_moe"))
    text = "\n".join(lines)
    assert "world 64 = dp_shard 64 x tp 1 (ep 8)" in text
    per_rank = float(next(line for line in lines if line.startswith("per-rank params")).split()[2])
    assert 100 < per_rank < 1000  # 31B params over 64 ranks with EP 8: hundreds of millions, not billions
    assert "74596 tokens/rank" in text and "fits: yes" in text
    assert "74096 tokens fits in one micro-batch" in text


@pytest.mark.parametrize(
    "name, sharding", [("sft_8b", "dp_shard 8 x tp 1"), ("grpo_8b", "dp_shard 2 x tp 4"), ("sft_30b_moe", "dp_shard 8")]
)
def test_one_override_sizes_a_paper_recipe_to_its_world(name, sharding):
    text = "\n".join(dry_run(load_recipe(name, ["job.world_size=8"])))
    assert f"world 8 = {sharding}" in text, text
    with pytest.raises(ValueError, match=r"set parallel\.dp_shard=-1 .*parallel\.tp and job\.world_size agree"):
        load_recipe(name, ["job.world_size=8", "parallel.dp_shard=16"])


def test_dry_run_says_what_would_make_a_plan_fit():
    """grpo_32b fits only with its CPU offload; without it the dry run says no and names the fixes."""
    lines = dry_run(load_recipe("grpo_32b", ["parallel.cpu_offload=false"]))
    verdict = next(line for line in lines if line.startswith("fits:"))
    assert verdict.startswith("fits: NO")
    advice = "\n".join(lines[lines.index(verdict) + 1 :])
    assert "with parallel.cpu_offload=true" in advice and "(fits)" in advice
    budget = int(advice.split("data.max_tokens <= ")[1].split()[0])
    assert 0 < budget < 74576
    assert next(line for line in dry_run(load_recipe("grpo_32b")) if line.startswith("fits:")).startswith("fits: yes")


def test_cli_errors_before_any_process_group(capsys):
    with pytest.raises(SystemExit):
        main(["--recipe", "grpo_8b", "--set", "grpo.eps_hihg=0.3"])
    assert "grpo.eps_hihg" in capsys.readouterr().err
    assert main(["--recipe", "tiny_sft", "--dry-run"]) == 0
    assert "no job.world_size" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--recipe", "tiny_grpo", "--set", "grpo.kl_coef=0.1"])
    assert "grpo.kl_coef > 0 needs a reference policy" in capsys.readouterr().err
