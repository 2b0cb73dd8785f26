"""The benchmark workload: lengths, layouts and the float64 objective every case is checked against."""

import pytest
import torch

from bench.kernels.workload import (
    Shape,
    chunked_target_logprobs,
    make_workload,
    ppo_clip_token_loss,
    reference_loss,
    seq_mean_token_mean_weight,
    split_lengths,
    to_padded,
)

TINY = Shape(num_tokens=40, vocab=37, hidden=8, num_seqs=5, dtype="fp32")


def test_split_lengths_cover_the_tokens_with_varied_lengths():
    lengths = split_lengths(1000, 7, torch.Generator().manual_seed(3))
    assert sum(lengths) == 1000 and len(lengths) == 7 and min(lengths) >= 1
    assert max(lengths) > min(lengths)  # real padding in the padded layout
    assert split_lengths(5, 5, torch.Generator()) == [1] * 5


@pytest.mark.parametrize("tokens, seqs", [(3, 4), (3, 0)])
def test_split_lengths_rejects_impossible_splits(tokens, seqs):
    with pytest.raises(ValueError, match="num_seqs"):
        split_lengths(tokens, seqs, torch.Generator())


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(dtype="int8"), "dtype"), (dict(num_tokens=0), "num_tokens"), (dict(num_seqs=41), "num_seqs")],
)
def test_shape_rejects_bad_values(kwargs, message):
    fields = dict(num_tokens=40, vocab=37, hidden=8, num_seqs=5, dtype="fp32") | kwargs
    with pytest.raises(ValueError, match=message):
        Shape(**fields)


def test_seq_mean_token_mean_weight():
    cu = torch.tensor([0, 2, 5, 5, 6], dtype=torch.int32)
    mask = torch.tensor([True, True, True, False, False, False])
    weight = seq_mean_token_mean_weight(cu, mask)
    torch.testing.assert_close(weight, torch.tensor([1 / 8, 1 / 8, 1 / 4, 0, 0, 0]))


def test_workload_is_deterministic_and_consistent():
    a, b = make_workload(TINY, "cpu", seed=1), make_workload(TINY, "cpu", seed=1)
    torch.testing.assert_close(a.logits(), b.logits())
    assert a.lengths == b.lengths and int(a.cu_seqlens[-1]) == TINY.num_tokens
    # old log-probs are the current ones plus small noise, so the importance ratios sit near 1
    drift = (a.old_logprobs - chunked_target_logprobs(a)).abs()
    assert 0 < drift.mean() < 0.3


def test_logits_are_built_in_fixed_row_chunks(monkeypatch):
    monkeypatch.setattr("bench.kernels.workload.LOGITS_CHUNK_ROWS", 16)
    w = make_workload(TINY, "cpu")
    assert [(r.start, r.stop) for r in w.row_chunks()] == [(0, 16), (16, 32), (32, 40)]
    torch.testing.assert_close(w.logits(), w.hidden @ w.weight.T)


def test_to_padded_round_trips_packed_rows():
    w = make_workload(TINY, "cpu")
    padded = to_padded(w, w.logits(), extra_row=True)
    assert padded.shape == (TINY.num_seqs, max(w.lengths) + 1, TINY.vocab)
    unpacked = torch.cat([padded[i, :n] for i, n in enumerate(w.lengths)])
    torch.testing.assert_close(unpacked, w.logits())
    assert padded[0, w.lengths[0] :].abs().sum() == 0


def test_reference_loss_is_the_materialised_objective_in_float64():
    w = make_workload(TINY, "cpu")
    logp = w.logits().double().log_softmax(-1).gather(1, w.target_ids[:, None]).squeeze(1)
    advantage = torch.repeat_interleave(w.advantages, torch.tensor(w.lengths)).double()
    per_token = ppo_clip_token_loss(logp, w.old_logprobs.double(), advantage)
    expected = float((per_token * w.token_weight.double()).sum())
    assert reference_loss(w) == pytest.approx(expected, rel=1e-12)
    assert expected != 0.0


def test_ppo_clip_token_loss_clips_one_sided_per_advantage_sign():
    old = torch.zeros(4, dtype=torch.float64)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5], dtype=torch.float64))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    torch.testing.assert_close(
        ppo_clip_token_loss(logp, old, adv), torch.tensor([-1.28, 1.5, -0.5, 0.8], dtype=torch.float64)
    )
