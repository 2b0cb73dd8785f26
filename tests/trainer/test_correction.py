"""The GRPO stage's old policy and mismatch correction against float64: the recomputed old log-probs,
the importance weights the fused loss applies with them (token and sequence level, truncate and
mask), the loss they give on the weights that generated the batch, and the |old - engine| histogram."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from osvl.config.recipe import GRPOConfig
from osvl.data.chat import ChatRenderer
from osvl.data.packing import TrainSequence, pack_microbatch
from osvl.data.vision_filler import with_grpo_filler
from osvl.step import grpo_loss_config, grpo_loss_on_hidden, packed_forward, policy_logprobs, rollout_correction
from osvl.trainer.correction import DELTA_EDGES, DELTA_NAMES, mismatch_metrics, mismatch_sums
from tests.rollout.helpers import IMAGE_CONFIG, tiny_model, tokenizer

TEMPERATURE = 0.7


def _batch(model, seed: int = 0):
    """Three text sequences (and the vision filler the stage appends) whose 'engine' log-probs are the
    model's own plus noise of a few 0.1 nats."""
    rng = np.random.default_rng(seed)
    tok = tokenizer()
    sequences = []
    for i, length in enumerate((9, 14, 6)):
        ids = rng.integers(0, tok.vocab_size, size=length).astype(np.int64)
        mask = np.ones(length, bool)
        mask[:3] = False  # the prompt
        sequences.append(
            TrainSequence(
                ids,
                mask,
                np.zeros(length, np.int64),
                np.zeros(length, np.float32),
                [],
                i,
                reward=0.0,
                advantage=(-1.0, 0.5, 2.0)[i],
            )
        )
    batch = with_grpo_filler(pack_microbatch(sequences, IMAGE_CONFIG, tok.special), ChatRenderer(tok, IMAGE_CONFIG))
    exact = reference_logprobs(model, batch)
    noise = torch.from_numpy(rng.normal(0.0, 0.3, size=exact.shape[0]))
    batch.old_logprobs = torch.where(batch.loss_mask, exact + noise, 0.0).float()  # what an engine reported
    return batch


def reference_logprobs(model, batch) -> torch.Tensor:
    """float64 log softmax(logits / T) of every target, from a float64 copy of the model."""
    wide = copy.deepcopy(model).double()
    with torch.no_grad():
        logits = wide(
            batch.input_ids,
            cu_seqlens=batch.cu_seqlens,
            position_ids=batch.position_ids,
            pixel_values=batch.pixel_values.double(),
            image_grid_thw=batch.image_grid_thw,
        )
    return torch.log_softmax(logits / TEMPERATURE, -1).gather(1, batch.target_ids[:, None])[:, 0]


def test_policy_logprobs_equal_a_float64_forward():
    model = tiny_model(3).eval()
    batch = _batch(model)
    old = policy_logprobs(model, batch, TEMPERATURE)
    reference = torch.where(batch.loss_mask, reference_logprobs(model, batch), 0.0)
    assert old.dtype == torch.float32 and not old.requires_grad
    assert torch.allclose(old.double(), reference, atol=2e-5, rtol=0)
    assert torch.all(old[~batch.loss_mask] == 0)


@pytest.mark.parametrize(
    ("level", "mode", "cap"), [("token", "truncate", 1.3), ("token", "mask", 1.3), ("sequence", "truncate", 1.5)]
)
def test_correction_weights_and_loss_equal_float64(level, mode, cap):
    model = tiny_model(3).eval()
    batch = _batch(model, seed=1)
    config = GRPOConfig(
        old_logprobs="trainer",
        rollout_correction=level,
        rollout_correction_mode=mode,
        rollout_correction_cap=cap,
        temperature=TEMPERATURE,
        loss_agg="token-mean",
    )
    old = policy_logprobs(model, batch, TEMPERATURE)
    on_device, hidden = packed_forward(model, batch)  # the trainer's step
    out = grpo_loss_on_hidden(model, hidden, on_device, grpo_loss_config(config), chunk_size=None, old_logprobs=old)

    valid = batch.loss_mask
    log_ratio = torch.where(valid, reference_logprobs(model, batch) - batch.old_logprobs.double(), 0.0)
    lengths = torch.diff(batch.cu_seqlens.long())
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    if level == "sequence":
        log_ratio = torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, seq, log_ratio)[seq]
    ratio = torch.exp(log_ratio)
    outside = (ratio > cap) & valid
    weights = ratio.clamp(max=cap) if mode == "truncate" else torch.where(outside, 0.0, ratio)
    n = valid.sum()
    assert float(out.metrics["is_weight_mean"]) == pytest.approx(float(weights[valid].mean()), rel=1e-5)
    assert float(out.metrics["is_capped_frac"]) == pytest.approx(float(outside.sum() / n), abs=1e-9)
    assert 0 < float(outside.sum()) < float(n)  # the noise puts some tokens past the cap, not all
    # on the weights that generated the batch the PPO ratio is 1: the loss is -mean(w * A) over the tokens
    advantage = batch.advantages.double()[seq]
    assert float(out.loss) == pytest.approx(float(-(weights * advantage)[valid].sum() / n), abs=1e-5)


def test_mismatch_histogram_equals_numpy():
    rng = np.random.default_rng(0)
    old = torch.from_numpy(rng.normal(size=400)).float()
    delta = torch.from_numpy(10.0 ** rng.uniform(-5, 0.6, size=400)).float()
    mask = torch.from_numpy(rng.random(400) < 0.8)
    sums = mismatch_sums(old, old - delta, mask)
    metrics = mismatch_metrics({k: float(v) for k, v in sums.items()})
    gaps = np.abs(old.double().numpy() - (old - delta).double().numpy())[mask.numpy()]
    counts, _ = np.histogram(gaps, bins=[0.0, *DELTA_EDGES, np.inf])
    assert [metrics[f"logprob_delta/{name}"] for name in DELTA_NAMES] == pytest.approx(counts / mask.sum().item())
    assert metrics["mismatch_abs_diff"] == pytest.approx(gaps.mean())
    assert mismatch_metrics({"mismatch_tokens": 0.0}) == {}


def test_correction_keys_are_checked():
    assert rollout_correction(GRPOConfig()) is None
    with pytest.raises(ValueError, match='needs old_logprobs = "trainer"'):
        GRPOConfig(rollout_correction="token")
    with pytest.raises(ValueError, match="rollout_correction_cap must be > 0"):
        GRPOConfig(old_logprobs="trainer", rollout_correction="token", rollout_correction_cap=0.0)
