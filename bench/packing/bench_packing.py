"""Packed vs padded micro-batches on CPU: wasted-token fraction and step throughput in one run.

One synthetic RL step (long-tailed sequence lengths, as multi-turn rollouts have) is trained
through a tiny causal transformer twice: padded (fixed sequences per micro-batch, padded to the
longest) and packed (``osvl.data`` plan under a token budget, per-document attention). Both use
the same model and data in the same process; the ratio is the result, not the absolute speed.

    python -m bench.packing.bench_packing [--out bench/packing/results/packing-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.kernels.report import git_info
from osvl.data.image import ImageConfig
from osvl.data.packing import PackingConfig, TrainSequence, pack_rank, plan_packing
from osvl.data.tokenizer import SpecialTokens

SCHEMA = "osvl.bench.packing/1"
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Workload:
    num_seqs: int = 48
    min_len: int = 16
    max_len: int = 512
    median_len: int = 120
    padded_batch: int = 8  # sequences per padded micro-batch
    max_tokens: int = 2048  # packed micro-batch budget
    vocab: int = 512
    dim: int = 256
    layers: int = 2
    heads: int = 4
    seed: int = 0


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def attend(self, x: torch.Tensor, cu_seqlens: list[int] | None, mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, L, D]; causal, with a [B, 1, L, L] padding mask or per-document over cu_seqlens."""
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if cu_seqlens is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:  # packed [1, T, D]: per-document SDPA, the CPU path of the real model
            out = torch.cat(
                [
                    F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True)
                    for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])
                ],
                dim=2,
            )
        return self.proj(out.transpose(1, 2).reshape(b, n, d))

    def forward(self, x: torch.Tensor, cu_seqlens: list[int] | None, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attend(self.norm1(x), cu_seqlens, mask)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, w: Workload) -> None:
        super().__init__()
        self.embed = nn.Embedding(w.vocab, w.dim)
        self.blocks = nn.ModuleList(Block(w.dim, w.heads) for _ in range(w.layers))
        self.head = nn.Linear(w.dim, w.vocab)

    def forward(
        self, ids: torch.Tensor, cu_seqlens: list[int] | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cu_seqlens, mask)
        return self.head(x)


def make_sequences(w: Workload) -> list[TrainSequence]:
    rng = np.random.default_rng(w.seed)
    lengths = np.clip(rng.lognormal(np.log(w.median_len), 0.8, w.num_seqs), w.min_len, w.max_len).astype(int)
    seqs = []
    for n in lengths:
        mask = np.zeros(n, bool)
        mask[n // 4 :] = True
        seqs.append(
            TrainSequence(
                rng.integers(0, w.vocab - 1, n).astype(np.int64),
                mask,
                np.zeros(n, np.int64),
                np.zeros(n, np.float32),
                [],
                group_id=0,
                reward=0.0,
            )
        )
    return seqs


def padded_step(model: TinyLM, seqs: list[TrainSequence], w: Workload) -> tuple[float, int, int]:
    """Returns (seconds, processed tokens, real tokens)."""
    processed = 0
    start = time.perf_counter()
    for i in range(0, len(seqs), w.padded_batch):
        chunk = seqs[i : i + w.padded_batch]
        longest = max(s.num_tokens for s in chunk)
        ids = torch.zeros(len(chunk), longest, dtype=torch.long)
        valid = torch.zeros(len(chunk), longest, dtype=torch.bool)
        for row, s in enumerate(chunk):
            ids[row, : s.num_tokens] = torch.from_numpy(s.input_ids)
            valid[row, : s.num_tokens] = True
        causal = torch.ones(longest, longest, dtype=torch.bool).tril()
        mask = (causal[None] & valid[:, None, :]) | torch.eye(longest, dtype=torch.bool)[None]
        logits = model(ids, mask=mask[:, None])
        targets = torch.where(valid[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], -100))
        F.cross_entropy(logits[:, :-1].reshape(-1, w.vocab), targets.reshape(-1), ignore_index=-100).backward()
        processed += len(chunk) * longest
    return time.perf_counter() - start, processed, sum(s.num_tokens for s in seqs)


def packed_step(
    model: TinyLM,
    seqs: list[TrainSequence],
    w: Workload,
    special: SpecialTokens,
) -> tuple[float, int, int, float]:
    """Returns (seconds, processed tokens, real tokens, plan fill fraction); planning is timed too."""
    start = time.perf_counter()
    plan = plan_packing([s.num_tokens for s in seqs], PackingConfig(max_tokens=w.max_tokens))
    batches = pack_rank(seqs, plan, 0, ImageConfig(), special)
    processed = 0
    for batch in batches:
        logits = model(batch.input_ids[None], cu_seqlens=batch.cu_seqlens.tolist())[0]
        targets = torch.where(
            batch.loss_mask | _not_last(batch.cu_seqlens, batch.num_tokens),
            batch.target_ids,
            torch.full_like(batch.target_ids, -100),
        )
        F.cross_entropy(logits, targets, ignore_index=-100).backward()
        processed += batch.num_tokens
    return time.perf_counter() - start, processed, sum(s.num_tokens for s in seqs), plan.fill_frac


def _not_last(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Rows with a next token in the same sequence (the padded path trains on the same rows)."""
    keep = torch.ones(total, dtype=torch.bool)
    keep[cu_seqlens[1:].long() - 1] = False
    return keep


def run(w: Workload, repeats: int) -> dict:
    torch.manual_seed(w.seed)
    seqs = make_sequences(w)
    special = SpecialTokens(**{name: w.vocab - 1 for name in SpecialTokens.NAMES})  # ids never drawn above
    model = TinyLM(w)
    padded_times, packed_times = [], []
    for trial in range(repeats + 1):  # the first round warms up both paths
        pt, p_processed, real = padded_step(model, seqs, w)
        kt, k_processed, _, fill = packed_step(model, seqs, w, special)
        model.zero_grad(set_to_none=True)
        if trial:
            padded_times.append(pt)
            packed_times.append(kt)
    padded_s, packed_s = statistics.median(padded_times), statistics.median(packed_times)
    return {
        "schema": SCHEMA,
        "git": git_info(REPO),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "workload": vars(w) | {"repeats": repeats},
        "real_tokens": real,
        "padded": {
            "processed_tokens": p_processed,
            "wasted_token_frac": 1 - real / p_processed,
            "step_s": padded_s,
            "tokens_per_s": real / padded_s,
        },
        "packed": {
            "processed_tokens": k_processed,
            "wasted_token_frac": 1 - real / k_processed,
            "budget_fill_frac": fill,
            "step_s": packed_s,
            "tokens_per_s": real / packed_s,
        },
        "throughput_ratio_packed_over_padded": padded_s / packed_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/packing/results/packing-cpu.json")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-seqs", type=int, default=Workload.num_seqs)
    args = parser.parse_args()
    if args.repeats < 1 or args.num_seqs < 1:
        raise ValueError("--repeats and --num-seqs must be >= 1")
    result = run(Workload(num_seqs=args.num_seqs), args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("padded", "packed", "throughput_ratio_packed_over_padded")}, indent=2))


if __name__ == "__main__":
    main()
