"""Rank bodies for the trainer's 2-rank tests; ``run_ranks`` is the shared spawn harness."""

from __future__ import annotations

from tests.parallel.harness import run_ranks

__all__ = ["grpo_body", "run_ranks", "sft_packing_body", "sft_resume_body"]


def sft_resume_body(rank: int, world: int, overrides_a: list[str], overrides_b: list[str]) -> None:
    """Run A: 4 steps straight. Run B: 2 steps, 'crash', then resume to 4."""
    from osvl.config import load_recipe
    from osvl.trainer import run_sft

    a = run_sft(load_recipe("tiny_sft", overrides_a), rank, world)
    assert a.steps == 4 and a.resumed_from == 0, a
    first = run_sft(load_recipe("tiny_sft", overrides_b), rank, world, stop_after=2)
    assert first.steps == 2, first
    second = run_sft(load_recipe("tiny_sft", overrides_b), rank, world)
    assert second.steps == 4 and second.resumed_from == 2, second


def sft_packing_body(rank: int, world: int, root: str, max_tokens: int, global_batch: int) -> None:
    """One epoch of SFT batches packed from deferred images and from eagerly rendered ones: the same
    tensors, and this rank decodes exactly the image files of the sequences it packs, each once."""
    import json
    from pathlib import Path

    import torch

    from osvl.data.chat import ChatRenderer
    from osvl.data.formats import tokenize_steps
    from osvl.data.image_files import ImageFileCache
    from osvl.data.packing import train_sequence
    from osvl.data.tokenizer import load_tokenizer
    from osvl.rl.trajectory import read_jsonl
    from osvl.trainer.index_stream import IndexStream
    from osvl.trainer.sft_data import load_sft_sequences, rank_microbatches
    from tests.trainer.sft_images import IMAGE_CONFIG, rendered_image_files

    data = Path(root) / "sft.jsonl"
    tokenizer = load_tokenizer(Path(root) / "tokenizer.json")
    renderer = ChatRenderer(tokenizer, IMAGE_CONFIG)
    cache = ImageFileCache()
    deferred = load_sft_sequences(data, renderer, image_cache=cache)
    eager = [
        train_sequence(tokenize_steps(t, tokenizer, keep_token_ids=True), renderer, reward=0.0)
        for t in read_jsonl(data)
    ]
    assert cache.num_decoded == 0, "loading decoded pixels"
    assert [s.num_tokens for s in deferred] == [s.num_tokens for s in eager]
    stream, packed = IndexStream(len(deferred), global_batch, seed=0), set()
    for _ in range(stream.steps_per_epoch):
        indices = stream.next_batch()
        new, new_valid, new_padding = rank_microbatches(deferred, indices, max_tokens, world, rank, renderer)
        old, old_valid, old_padding = rank_microbatches(eager, indices, max_tokens, world, rank, renderer)
        assert (new_valid, new_padding, len(new)) == (old_valid, old_padding, len(old))
        for a, b in zip(new, old):
            for name, value in vars(b).items():
                assert (
                    torch.equal(getattr(a, name), value)
                    if isinstance(value, torch.Tensor)
                    else getattr(a, name) == value
                ), name
            packed |= set(a.group_ids.tolist())  # group id = the sequence's line
    files = rendered_image_files(data, packed)
    assert cache.num_decoded == len(files), (cache.num_decoded, len(files))
    (Path(root) / f"rank{rank}.json").write_text(json.dumps({"packed": sorted(packed), "files": sorted(files)}))


def grpo_body(rank: int, world: int, overrides: list[str]) -> None:
    """A few GRPO steps of the scripted policy against echo tools with injected faults."""
    from osvl.config import load_recipe
    from osvl.trainer import run_grpo
    from tests.trainer.grpo_fixtures import echo_environment, scripted

    result = run_grpo(
        load_recipe("tiny_grpo", overrides), rank, world, environment=echo_environment, engine_wrapper=scripted
    )
    assert result.steps == 2 and result.resumed_from == 0, result
