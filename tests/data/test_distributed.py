"""Global normalisers over 2 gloo ranks: one all-reduce gives the whole step's totals."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from osvl.data.distributed import global_normalizers
from osvl.data.image import ImageConfig
from osvl.data.packing import PackingConfig, TrainSequence, pack_microbatch, pack_rank, plan_packing
from osvl.data.tokenizer import SpecialTokens

SPECIAL = SpecialTokens(**{name: 1000 + i for i, name in enumerate(SpecialTokens.NAMES)})
IMAGES = ImageConfig()


def sequences() -> list[TrainSequence]:
    rng = np.random.default_rng(5)
    seqs = []
    for i in range(9):
        n = int(rng.integers(5, 40))
        mask = np.zeros(n, bool)
        mask[n // 2 :] = True
        step = np.where(mask, 1 + (np.arange(n) % 2), 0).astype(np.int64)
        seqs.append(
            TrainSequence(
                rng.integers(0, 500, n).astype(np.int64),
                mask,
                step,
                np.zeros(n, np.float32),
                [],
                group_id=i // 3,
                reward=1.0,
                fatal_step=2 if i % 4 == 0 else -1,
            )
        )
    return seqs


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        seqs = sequences()
        plan = plan_packing([s.num_tokens for s in seqs], PackingConfig(max_tokens=60, num_ranks=world))
        batches = pack_rank(seqs, plan, rank, IMAGES, SPECIAL)
        norms = global_normalizers(batches)
        local = [sum(b.num_seqs for b in batches), sum(b.num_valid_tokens for b in batches)]
        np.save(
            os.path.join(out_dir, f"rank{rank}.npy"),
            np.array([norms.num_seqs.item(), norms.num_valid_tokens.item(), *local]),
        )
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_agree_on_global_totals(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    results = [np.load(tmp_path / f"rank{r}.npy") for r in range(2)]
    seqs = sequences()
    totals = [len(seqs), sum(s.num_valid_tokens for s in seqs)]
    for result in results:
        assert result[:2].tolist() == totals  # every rank holds the global numbers
    assert all(r[2] > 0 for r in results)  # both ranks had work: the totals are real sums
    assert sum(r[2] for r in results) == totals[0] and sum(r[3] for r in results) == totals[1]


def test_single_process_falls_back_to_local_counts():
    seqs = sequences()
    norms = global_normalizers([pack_microbatch(seqs[:4], IMAGES, SPECIAL), pack_microbatch([], IMAGES, SPECIAL)])
    assert norms.num_seqs.item() == 4
    assert norms.num_valid_tokens.item() == sum(s.num_valid_tokens for s in seqs[:4])
    assert norms.num_seqs.dtype == torch.int64
