"""Packed micro-batches: layout, shifted targets, MRoPE restarts, images, and the fused loss contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from osvl.data.chat import ChatRenderer
from osvl.data.image import ImageConfig, pixel_values
from osvl.data.mrope import mrope_position_ids
from osvl.data.packing import (
    PackingConfig,
    TrainSequence,
    pack_microbatch,
    pack_rank,
    plan_packing,
    train_sequence,
)
from osvl.rl.trajectory import RewardParts
from osvl_kernels import grpo_loss
from tests.data.helpers import TOOLS, search_trajectory, tiny_tokenizer

IMAGES = ImageConfig(min_pixels=32 * 32, max_pixels=32 * 32 * 8)
SPECIAL = tiny_tokenizer().special


def synthetic(rng: np.random.Generator, length: int, group: int, fatal: int = -1) -> TrainSequence:
    """Text-only sequence: prompt (step 0), then 3 steps alternating policy and observation runs."""
    ids = rng.integers(0, 200, size=length).astype(np.int64)
    cuts = np.sort(rng.choice(np.arange(1, length), size=min(5, length - 1), replace=False)) if length > 1 else []
    mask = np.zeros(length, bool)
    step = np.zeros(length, np.int64)
    bounds = [0, *cuts, length]
    for run, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        mask[a:b] = run % 2 == 1
        step[a:b] = max(run - 1, 0) // 2
    logprobs = np.where(mask, -rng.random(length), 0).astype(np.float32)
    return TrainSequence(ids, mask, step, logprobs, [], group_id=group, reward=float(rng.random()), fatal_step=fatal)


@pytest.fixture(scope="module")
def rendered():
    tok = tiny_tokenizer()
    renderer = ChatRenderer(tok, IMAGES, tools=TOOLS)
    seqs = []
    for sample in range(3):
        traj = search_trajectory(tok, group_id=7, sample_index=sample)
        traj.reward = RewardParts(fmt=1.0, acc=1.0, query=0.5, total=0.9 - 0.1 * sample)
        traj.fatal_step = 2 if sample == 2 else -1
        seqs.append(train_sequence(traj, renderer))
    return seqs


def test_layout_and_shift_inside_each_sequence(rendered):
    batch = pack_microbatch(rendered, IMAGES, SPECIAL)
    cu = batch.cu_seqlens.tolist()
    assert batch.cu_seqlens.dtype == torch.int32 and cu == [0, *np.cumsum([s.num_tokens for s in rendered])]
    for seq, start, end in zip(rendered, cu[:-1], cu[1:]):
        assert batch.input_ids[start:end].tolist() == seq.input_ids.tolist()
        assert batch.target_ids[start : end - 1].tolist() == seq.input_ids[1:].tolist()
        assert not batch.loss_mask[end - 1]  # no target crosses into the next sequence
        assert batch.loss_mask[start : end - 1].tolist() == seq.loss_mask[1:].tolist()
        assert batch.token_step[start : end - 1].tolist() == seq.token_step[1:].tolist()
        np.testing.assert_array_equal(batch.old_logprobs[start : end - 1].numpy(), seq.logprobs[1:])
        expected = mrope_position_ids(seq.input_ids, [i.grid_thw for i in seq.images], SPECIAL.image_pad)
        assert batch.position_ids[:, start:end].tolist() == expected.tolist()
        assert batch.position_ids[:, start].tolist() == [0, 0, 0]  # restarts per sequence
    assert batch.input_ids.dtype == batch.target_ids.dtype == torch.int64
    assert batch.position_ids.shape == (3, batch.num_tokens) and batch.loss_mask.dtype == torch.bool
    assert batch.group_ids.tolist() == [7, 7, 7] and batch.fatal_step.tolist() == [-1, -1, 2]
    assert batch.rewards.tolist() == pytest.approx([0.9, 0.8, 0.7]) and batch.advantages is None


def test_images_are_concatenated_in_sequence_order(rendered):
    batch = pack_microbatch(rendered, IMAGES, SPECIAL)
    images = [image for seq in rendered for image in seq.images]
    assert batch.image_grid_thw.tolist() == [list(i.grid_thw) for i in images]
    assert batch.pixel_values.shape == (sum(i.num_patches for i in images), IMAGES.patch_dim)
    np.testing.assert_array_equal(batch.pixel_values.numpy(), pixel_values(images, IMAGES))
    assert int((batch.input_ids == SPECIAL.image_pad).sum()) == sum(i.num_tokens for i in images)


def test_valid_tokens_respect_the_fatal_step(rendered):
    batch = pack_microbatch(rendered, IMAGES, SPECIAL)
    fatal = rendered[2]
    assert fatal.num_valid_tokens == int((fatal.loss_mask & (fatal.token_step < 2)).sum())
    assert batch.num_valid_tokens == sum(s.num_valid_tokens for s in rendered) and batch.num_seqs == 3


def test_batch_feeds_grpo_loss_and_packing_does_not_leak_across_sequences(rendered):
    torch.manual_seed(0)
    vocab = tiny_tokenizer().vocab_size
    table = torch.randn(vocab, vocab, dtype=torch.float64)

    def loss_of(seqs, advantages, num_seqs):
        batch = pack_microbatch(seqs, IMAGES, SPECIAL)
        logits = table[batch.input_ids].float().requires_grad_()  # each row depends on its own token only
        out = grpo_loss(
            logits,
            batch.target_ids,
            batch.cu_seqlens,
            batch.loss_mask,
            old_logprobs=batch.old_logprobs,
            advantages=torch.tensor(advantages),
            fatal_step=batch.fatal_step,
            token_step=batch.token_step,
            num_seqs=num_seqs,
            backend="torch",
        )
        return out.loss

    advantages = [1.0, -0.5, 0.25]
    together = loss_of(rendered, advantages, 3)
    apart = sum(loss_of([seq], [adv], 3) for seq, adv in zip(rendered, advantages))
    assert torch.isfinite(together) and together.item() != 0.0
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-6)


def test_filler_batch_has_one_token_and_no_loss():
    batch = pack_microbatch([], IMAGES, SPECIAL)
    assert batch.num_tokens == 1 and batch.num_seqs == 0 and batch.num_valid_tokens == 0
    assert batch.input_ids.tolist() == [SPECIAL.endoftext] and not batch.loss_mask.any()
    assert batch.pixel_values.shape == (0, IMAGES.patch_dim) and batch.image_grid_thw.shape == (0, 3)
    logits = torch.randn(1, tiny_tokenizer().vocab_size, requires_grad=True)
    out = grpo_loss(
        logits,
        batch.target_ids,
        batch.cu_seqlens,
        batch.loss_mask,
        advantages=batch.advantages,
        num_seqs=4,
        backend="torch",
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and (logits.grad == 0).all()


def test_advantages_travel_when_every_sequence_has_one():
    rng = np.random.default_rng(0)
    seqs = [synthetic(rng, 10, 0), synthetic(rng, 12, 0)]
    seqs[0].advantage, seqs[1].advantage = 0.5, -0.5
    assert pack_microbatch(seqs, IMAGES, SPECIAL).advantages.tolist() == [0.5, -0.5]


def test_to_moves_every_tensor(rendered):
    batch = pack_microbatch(rendered[:1], IMAGES, SPECIAL).to("cpu")
    assert batch.num_seqs == 1 and batch.input_ids.device.type == "cpu"


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 60), min_size=2, max_size=24),
    st.integers(1, 3),
    st.integers(60, 150),
    st.integers(0, 2**31 - 1),
)
def test_every_token_once_no_sequence_crosses_a_boundary(lengths, ranks, budget, seed):
    if len(lengths) < ranks:
        ranks = len(lengths)
    rng = np.random.default_rng(seed)
    seqs = [synthetic(rng, n, group=i // 2) for i, n in enumerate(lengths)]
    plan = plan_packing([s.num_tokens for s in seqs], PackingConfig(max_tokens=budget, num_ranks=ranks))
    seen = []
    for rank in range(ranks):
        batches = pack_rank(seqs, plan, rank, IMAGES, SPECIAL)
        assert len(batches) == plan.num_microbatches
        for bin_, batch in zip(plan.ranks[rank], batches):
            assert batch.num_tokens <= budget
            cu = batch.cu_seqlens.tolist()
            if not bin_:
                assert batch.num_seqs == 0
                continue
            for index, start, end in zip(bin_, cu[:-1], cu[1:]):
                assert batch.input_ids[start:end].tolist() == seqs[index].input_ids.tolist()
                assert not batch.loss_mask[end - 1]
                seen.append(index)
    assert sorted(seen) == list(range(len(seqs)))


def test_train_sequence_needs_a_reward():
    tok = tiny_tokenizer()
    renderer = ChatRenderer(tok, IMAGES)
    traj = search_trajectory(tok)
    with pytest.raises(ValueError, match="no reward"):
        train_sequence(traj, renderer)
    traj.reward = RewardParts(fmt=1.0, acc=None, query=None, total=None, unscored_reason="timeout")
    with pytest.raises(ValueError, match="unscored"):
        train_sequence(traj, renderer)
    assert train_sequence(traj, renderer, reward=0.0).reward == 0.0


def test_pack_rank_errors(rendered):
    plan = plan_packing([s.num_tokens for s in rendered], PackingConfig(max_tokens=10_000))
    with pytest.raises(ValueError, match="rank 1 not in plan"):
        pack_rank(rendered, plan, 1, IMAGES, SPECIAL)
    with pytest.raises(ValueError, match="plan covers 3"):
        pack_rank(rendered[:2], plan, 0, IMAGES, SPECIAL)
