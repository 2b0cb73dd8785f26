"""Vocab-parallel (TP) paths on 2 gloo ranks: every result equals the unsharded computation.

One spawned run (process groups cost seconds) executes every TP case and saves what each rank
saw; the tests below compare those records with the unsharded torch path and the float64
reference in this process.
"""

from __future__ import annotations

import importlib.util
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from osvl_kernels import linear_grpo_loss, linear_token_logprobs, token_logprobs
from osvl_kernels.loss_config import LossHyper
from osvl_kernels.reference import reference_grpo_loss, reference_token_logprobs
from osvl_kernels.token_pass import row_stats, token_pass
from osvl_kernels.vocab_parallel import VocabShard, all_reduce_row_stats, vocab_parallel_token_pass, vocab_shard
from tests.kernels.packed import random_packed_batch

BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("osvl_kernels.triton_token_pass") else [])
WORLD = 2
BATCH = dict(seed=41, vocab=67, num_seqs=8, max_len=9, group_size=4)
UNEVEN = (40, 27)  # laid out from all-gathered sizes
EVEN = (34, 33)  # passed as explicit vocab_start
LOSS_KEYS = (
    "target_ids",
    "cu_seqlens",
    "loss_mask",
    "old_logprobs",
    "rewards",
    "group_ids",
    "fatal_step",
    "token_step",
    "ref_logprobs",
)
OPTIONS = dict(kl_coef=0.1, entropy_coef=0.02, dual_clip=3.0, temperature=0.9)
ON_POLICY = dict(loss_agg="token-mean", estimator="rloo", override={"old_logprobs": None})
CHUNK = 8
SCALE = 1.5  # upstream gradient of the loss


def shard_rows(sizes: tuple[int, ...], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def loss_inputs(batch: dict, override: dict | None = None) -> dict:
    inputs = {k: batch[k] for k in LOSS_KEYS}
    inputs.update(override or {})
    return inputs


def run_loss(hidden, weight, batch, *, scale=SCALE, **kwargs) -> dict:
    """Loss outputs and gradients of one linear_grpo_loss call, as plain tensors."""
    kwargs = dict(kwargs)
    override = kwargs.pop("override", None)
    out = linear_grpo_loss(hidden, weight, **loss_inputs(batch, override), chunk_size=CHUNK, **kwargs)
    if out.loss.requires_grad:
        (out.loss * scale).backward()
    return dict(
        loss=out.loss.detach(),
        logprobs=out.logprobs,
        advantages=out.advantages,
        metrics=out.metrics,
        grad_hidden=hidden.grad,
        grad_weight=weight.grad,
    )


def capture_error(fn) -> str:
    try:
        fn()
    except ValueError as error:
        return str(error)
    return "no error"


def tp_worker(rank: int, port: int, out_dir: str, backends: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120)
    )
    group = dist.group.WORLD
    record: dict = {}
    try:
        batch = random_packed_batch(**BATCH)
        uneven, even = shard_rows(UNEVEN, rank), shard_rows(EVEN, rank)
        hidden, weight = batch["hidden"], batch["weight"]
        record["shard"] = vocab_shard(UNEVEN[rank], group, torch.device("cpu"))

        for backend in backends:
            record[f"loss-{backend}"] = run_loss(
                hidden.clone().requires_grad_(),
                weight[uneven].clone().requires_grad_(),
                batch,
                tp_group=group,
                backend=backend,
                **OPTIONS,
            )
        for validate in (True, False):
            record[f"explicit-validate={validate}"] = run_loss(
                hidden.clone().requires_grad_(),
                weight[even].clone(),
                batch,
                tp_group=group,
                vocab_start=even.start,
                validate=validate,
                backend="torch",
                **ON_POLICY,
            )

        logits = hidden @ weight.T
        logits[0, UNEVEN[0] :] = float("-inf")  # rank 1 holds no finite logit of row 0
        targets = batch["target_ids"].clone()
        targets[0] = 3
        for backend in backends:
            record[f"token_logprobs-{backend}"] = token_logprobs(
                logits[:, uneven], targets, temperature=0.9, return_entropy=True, tp_group=group, backend=backend
            )
        record["linear_token_logprobs"] = linear_token_logprobs(
            hidden,
            weight[uneven],
            targets,
            temperature=0.9,
            return_entropy=True,
            tp_group=group,
            chunk_size=4,
            backend="torch",
        )

        every_row = torch.ones_like(batch["loss_mask"])
        stats = row_stats(logits[:, uneven], targets, every_row, uneven.start, 0.9, "torch")
        record["row_stats"] = all_reduce_row_stats(stats, group)

        valid = batch["loss_mask"]

        weights = valid.float() / 10
        advantage = torch.linspace(-1.0, 1.0, valid.numel())
        hyper = LossHyper(**OPTIONS)
        shard_logits = logits[:, uneven].clone()
        result = vocab_parallel_token_pass(
            shard_logits,
            targets,
            uneven.start,
            weights,
            advantage,
            batch["old_logprobs"],
            batch["ref_logprobs"],
            hyper,
            shard_logits,
            group,
            backend="torch",
        )
        record["token_pass"] = dict(logp=result.logp, loss=result.loss, grad=shard_logits)

        bad_targets = batch["target_ids"].clone()
        bad_targets[batch["loss_mask"].nonzero()[0, 0]] = BATCH["vocab"]
        record["errors"] = {
            "overlap": capture_error(
                lambda: vocab_shard(EVEN[rank], group, torch.device("cpu"), vocab_start=(0, 30)[rank])
            ),
            "mixed": capture_error(
                lambda: vocab_shard(EVEN[rank], group, torch.device("cpu"), vocab_start=(0, None)[rank])
            ),
            "target": capture_error(
                lambda: linear_grpo_loss(
                    hidden,
                    weight[uneven],
                    **loss_inputs(batch, {"target_ids": bad_targets}),
                    tp_group=group,
                    backend="torch",
                )
            ),
            "logprob_target": capture_error(
                lambda: token_logprobs(logits[:, uneven], bad_targets, tp_group=group, backend="torch")
            ),
        }
    finally:
        torch.save(record, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("tp")
    mp.spawn(tp_worker, args=(free_port(), str(out_dir), BACKENDS), nprocs=WORLD, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def batch() -> dict:
    return random_packed_batch(**BATCH)


def unsharded(batch: dict, *, weight_grad: bool = True, **kwargs) -> dict:
    return run_loss(
        batch["hidden"].clone().requires_grad_(),
        batch["weight"].clone().requires_grad_(weight_grad),
        batch,
        backend="torch",
        **kwargs,
    )


def assert_same_loss_outputs(got: dict, expected: dict, tol: float = 1e-5) -> None:
    torch.testing.assert_close(got["loss"], expected["loss"], rtol=tol, atol=tol)
    torch.testing.assert_close(got["logprobs"], expected["logprobs"], rtol=tol, atol=tol)
    torch.testing.assert_close(got["advantages"], expected["advantages"])
    assert got["metrics"].keys() == expected["metrics"].keys()
    for key, value in expected["metrics"].items():
        torch.testing.assert_close(got["metrics"][key], value, rtol=tol, atol=tol, msg=key)
    torch.testing.assert_close(got["grad_hidden"], expected["grad_hidden"], rtol=tol, atol=tol)


def test_both_shards_own_targets_of_loss_tokens(batch):
    targets = batch["target_ids"][batch["loss_mask"]]
    for sizes in (UNEVEN, EVEN):
        assert (targets < sizes[0]).any() and (targets >= sizes[0]).any()


def test_uneven_shards_are_laid_out_in_rank_order(ranks):
    assert [r["shard"] for r in ranks] == [VocabShard(0, 40, 67), VocabShard(40, 27, 67)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp_linear_grpo_loss_equals_unsharded(ranks, batch, backend):
    expected = unsharded(batch, **OPTIONS)
    z = batch["hidden"].double().requires_grad_()
    w = batch["weight"].double().requires_grad_()
    ref_loss, ref_logp, _ = reference_grpo_loss(z @ w.T, **loss_inputs(batch), **OPTIONS)
    (ref_loss * SCALE).backward()
    for rank, record in enumerate(ranks):
        got = record[f"loss-{backend}"]
        assert_same_loss_outputs(got, expected)
        rows = shard_rows(UNEVEN, rank)
        torch.testing.assert_close(got["grad_weight"], expected["grad_weight"][rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["loss"].double(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["logprobs"].double(), ref_logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["grad_hidden"].double(), z.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["grad_weight"].double(), w.grad[rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("validate", [True, False])
def test_tp_explicit_vocab_start_with_hidden_grad_only(ranks, batch, validate):
    expected = unsharded(batch, weight_grad=False, **ON_POLICY)
    for record in ranks:
        got = record[f"explicit-validate={validate}"]
        assert_same_loss_outputs(got, expected)
        assert got["grad_weight"] is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp_token_logprobs_equal_unsharded_with_an_all_masked_shard_row(ranks, batch, backend):
    logits = batch["hidden"] @ batch["weight"].T
    logits[0, UNEVEN[0] :] = float("-inf")
    targets = batch["target_ids"].clone()
    targets[0] = 3
    ref_logp, ref_entropy = reference_token_logprobs(logits, targets, 0.9)
    # The float64 reference takes 0 * -inf = nan in row 0's entropy; score that row on its finite part.
    ref_logp[:1], ref_entropy[:1] = reference_token_logprobs(logits[:1, : UNEVEN[0]], targets[:1], 0.9)
    for record in ranks:
        logp, entropy = record[f"token_logprobs-{backend}"]
        assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
        torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)


def test_tp_linear_token_logprobs_equal_unsharded(ranks, batch):
    targets = batch["target_ids"].clone()
    targets[0] = 3
    logits = batch["hidden"].double() @ batch["weight"].double().T
    ref_logp, ref_entropy = reference_token_logprobs(logits, targets, 0.9)
    for record in ranks:
        logp, entropy = record["linear_token_logprobs"]
        torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)


def test_all_reduced_row_stats_equal_whole_vocab_stats(ranks, batch):
    logits = batch["hidden"] @ batch["weight"].T
    logits[0, UNEVEN[0] :] = float("-inf")
    targets = batch["target_ids"].clone()
    targets[0] = 3
    whole = row_stats(logits, targets, torch.ones_like(batch["loss_mask"]), 0, 0.9, "torch")
    for record in ranks:
        got = record["row_stats"]
        torch.testing.assert_close(got.max, whole.max)
        for name in ("sumexp", "zexp", "target"):
            torch.testing.assert_close(getattr(got, name), getattr(whole, name), rtol=1e-5, atol=1e-5, msg=name)


def test_vocab_parallel_token_pass_writes_this_shards_gradient(ranks, batch):
    logits = batch["hidden"] @ batch["weight"].T
    logits[0, UNEVEN[0] :] = float("-inf")
    targets = batch["target_ids"].clone()
    targets[0] = 3
    valid = batch["loss_mask"]
    grad = torch.empty_like(logits)
    whole = token_pass(
        logits,
        targets,
        valid.float() / 10,
        torch.linspace(-1.0, 1.0, valid.numel()),
        batch["old_logprobs"],
        batch["ref_logprobs"],
        LossHyper(**OPTIONS),
        grad,
        backend="torch",
    )
    for rank, record in enumerate(ranks):
        got = record["token_pass"]
        torch.testing.assert_close(got["logp"], whole.logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["loss"], whole.loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["grad"], grad[:, shard_rows(UNEVEN, rank)], rtol=1e-5, atol=1e-6)


def test_tp_bad_input_raises_the_same_value_error_on_every_rank(ranks):
    for record in ranks:
        errors = record["errors"]
        assert "must tile [0, 67)" in errors["overlap"]
        assert "on every rank of tp_group or on none" in errors["mixed"]
        assert "target_ids of loss tokens must be in [0, 67)" in errors["target"]
        assert "every target_id must be in [0, 67)" in errors["logprob_target"]


def test_vocab_shard_without_a_group_is_the_whole_vocab():
    assert vocab_shard(50, None, torch.device("cpu")) == VocabShard(0, 50, 50)
    assert vocab_shard(50, None, torch.device("cpu"), vocab_start=0) == VocabShard(0, 50, 50)
    with pytest.raises(ValueError, match="needs tp_group"):
        vocab_shard(50, None, torch.device("cpu"), vocab_start=10)


def test_a_group_without_an_initialised_process_group_is_a_value_error():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="not initialised"):
        vocab_shard(50, object(), torch.device("cpu"))
