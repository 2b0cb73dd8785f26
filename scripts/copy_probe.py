"""Does a CPU-sized policy learn to copy a span it has seen, and after how many steps?

A policy trained from random weights must copy the names it reads into its next query. This
probe trains a CPU preset (from random weights) on documents whose second and third parts
repeat the first, and prints how many repeated tokens it predicts (teacher-forced argmax) as
training goes. A sharp rise is the copying (induction) circuit forming. ``--untied`` gives the
preset its own lm_head: untied, neither size forms the circuit within 800 steps on uniform ids, tied
``small`` does within ~200 (docs/demo.md).

    python scripts/copy_probe.py --tokenizer TOK.json --source random            # uniform ids
    python scripts/copy_probe.py --tokenizer TOK.json --source random --zipf     # Zipf ids
    python scripts/copy_probe.py --tokenizer TOK.json --source random --separator-every 3
    python scripts/copy_probe.py --tokenizer TOK.json --source text --text LISTS.jsonl [--mix-random 0.5]

``--source text`` reads ``{"text": "List: ...\\nRepeat: ...\\nAgain: ..."}`` records (e.g.
``python -m osvl.synth reading --copy-fraction 1``); the first ``\\nRepeat:`` marks where copies start.
Output: one JSON line per ``--every`` steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import sys

import torch
import torch.nn.functional as F

from osvl.config import load_recipe
from osvl.data.formats import iter_text
from osvl.data.tokenizer import load_tokenizer
from osvl.trainer.policy import build_policy, policy_arch

Document = tuple[list[int], int]  # token ids, index of the first token that repeats earlier content


def random_document(
    rng: random.Random, vocab: int, length: int, zipf: bool, separator_every: int, separator: int
) -> Document:
    weights = [1.0 / (rank + 1) for rank in range(vocab)] if zipf else None
    segment = rng.choices(range(vocab), weights=weights, k=length)
    if separator_every:
        segment = [separator if (i + 1) % separator_every == 0 else t for i, t in enumerate(segment)]
    return segment * 3, length


def text_documents(path: str, tokenizer, limit: int) -> list[Document]:
    docs = []
    for text in itertools.islice(iter_text(path), limit):
        head, marker, _ = text.partition("\nRepeat:")
        if not marker:
            raise ValueError(f"{path}: a document has no '\\nRepeat:' marker: {text[:80]!r}")
        docs.append((tokenizer.encode(text), len(tokenizer.encode(head + marker))))
    if not docs:
        raise ValueError(f"{path} holds no documents")
    return docs


def repeat_accuracy(logits: torch.Tensor, ids: torch.Tensor, bounds: list[int], docs: list[Document]) -> float:
    rows = torch.zeros(len(ids), dtype=torch.bool)
    for (tokens, first), start in zip(docs, bounds, strict=False):
        rows[start + first - 1 : start + len(tokens) - 1] = True  # row r predicts token r + 1
    if not rows.any():
        return float("nan")
    return (logits[rows].argmax(-1) == torch.roll(ids, -1)[rows]).float().mean().item()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--source", choices=("random", "text"), required=True)
    parser.add_argument("--text", help="with --source text: JSONL of list/repeat documents")
    parser.add_argument("--mix-random", type=float, default=0.0, help="with --source text: share of random documents")
    parser.add_argument("--vocab", type=int, default=700, help="random ids are drawn from [0, vocab)")
    parser.add_argument("--length", type=int, default=30, help="random segment length")
    parser.add_argument("--zipf", action="store_true")
    parser.add_argument("--separator-every", type=int, default=0)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", default="small", help="a CPU preset (osvl.trainer.policy.CPU_SIZES)")
    parser.add_argument("--untied", action="store_true", help="an lm_head of its own instead of the preset's")
    args = parser.parse_args(argv)
    if args.source == "text" and not args.text:
        parser.error("--source text needs --text")
    if not 0.0 <= args.mix_random <= 1.0 or min(args.steps, args.batch, args.every, args.length) < 1:
        parser.error("--mix-random must lie in [0, 1]; --steps, --batch, --every, --length must be >= 1")
    tokenizer = load_tokenizer(args.tokenizer)
    if not 1 <= args.vocab <= tokenizer.vocab_size:
        parser.error(f"--vocab must lie in [1, {tokenizer.vocab_size}]")
    overrides = [f"data.tokenizer={args.tokenizer}", "model.pretrained=", f"job.seed={args.seed}"]
    recipe = load_recipe("tiny_sft", [*overrides, f"model.preset={args.preset}"])
    arch = policy_arch(recipe, tokenizer.vocab_size, tokenizer.special)
    if args.untied:
        arch = dataclasses.replace(arch, tie_word_embeddings=False)
    model = build_policy(recipe, arch, world_size=1)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    texts = text_documents(args.text, tokenizer, 20000) if args.source == "text" else []
    separator = tokenizer.encode(";")[0]

    def draw() -> tuple[Document, bool]:
        if texts and rng.random() >= args.mix_random:
            return rng.choice(texts), False
        return random_document(rng, args.vocab, args.length, args.zipf, args.separator_every, separator), True

    records = []
    for step in range(1, args.steps + 1):
        drawn = [draw() for _ in range(args.batch)]
        docs = [d for d, _ in drawn]
        bounds = [0, *itertools.accumulate(len(tokens) for tokens, _ in docs)]
        ids = torch.tensor([t for tokens, _ in docs for t in tokens])
        logits = model(ids, cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
        rows = torch.ones(len(ids), dtype=torch.bool)
        rows[torch.tensor(bounds[1:]) - 1] = False  # no target past a document's end
        loss = F.cross_entropy(logits[rows], torch.roll(ids, -1)[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % args.every == 0:
            with torch.no_grad():
                record = {"step": step, "loss": round(loss.item(), 4)}
                for name, want in (("repeat_acc_random", True), ("repeat_acc_text", False)):
                    chosen = [(d, b) for (d, is_random), b in zip(drawn, bounds, strict=False) if is_random == want]
                    if chosen:
                        record[name] = round(
                            repeat_accuracy(logits.detach(), ids, [b for _, b in chosen], [d for d, _ in chosen]), 4
                        )
            records.append(record)
            print(json.dumps(record), flush=True)
    return records


if __name__ == "__main__":
    main(sys.argv[1:])
