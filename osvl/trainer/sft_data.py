"""SFT trajectories -> packed micro-batches (drawn in the order of :mod:`osvl.trainer.index_stream`).

Synthesised SFT trajectories carry text, not engine ids: each step is tokenized here (generation +
``<|im_end|>``, so the model learns to stop), each distinct text once. Every rank lays out the
tokens of the whole set and plans the same packing, so the global loss normaliser needs no
collective. An image's pad tokens need only its size, so osvl JSONL images stay files until a
micro-batch that holds them is packed, each decoded and resized once per process
(:mod:`osvl.data.image_files`): a rank makes the pixels of its own share only.

``data.format`` picks the reader: osvl JSONL, or the released LLaMA-Factory ShareGPT files, whose
records are rendered with their own system prompt and tool schema (what the released checkpoints
were trained on). Records a reader rejects are counted and logged, never fatal.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from osvl.config.loader import read_prompt_file
from osvl.config.recipe import STAGE_FORMATS, DataConfig
from osvl.data.chat import ChatRenderer, TrajectoryImages
from osvl.data.formats import (
    FileStats,
    SFTRecord,
    detect_format,
    iter_sharegpt,
    iter_text,
    text_windows,
    tokenize_steps,
)
from osvl.data.image import DeferredImage, ImageConfig
from osvl.data.image_files import ImageFile, ImageFileCache
from osvl.data.packing import (
    PackedBatch,
    PackingConfig,
    TrainSequence,
    pack_rank,
    plan_packing,
    text_sequence,
    train_sequence,
)
from osvl.data.tokenizer import CachedTokenizer
from osvl.data.vision_filler import with_vision_filler
from osvl.jsonl import iter_jsonl
from osvl.rl.trajectory import Trajectory, default_images_dir, image_hashes, trajectory_from_dict

log = logging.getLogger(__name__)


def as_data_config(source: str | Path | DataConfig) -> DataConfig:
    """A bare path is ``data.train_path`` with every other data key at its default (format auto)."""
    return source if isinstance(source, DataConfig) else DataConfig(train_path=str(source))


def resolve_format(data: DataConfig, stage: str) -> str:
    """The reader ``data.train_path`` needs: the recipe's choice, or the detected one for ``auto``."""
    path = Path(data.train_path)
    if not path.is_file():
        raise ValueError(f"data.train_path: {path} does not exist")
    fmt = detect_format(path) if data.format == "auto" else data.format
    if fmt not in STAGE_FORMATS[stage]:
        raise ValueError(
            f"data.train_path: {path} is {fmt} data, which the {stage} stage does not read "
            f"(it reads {[f for f in STAGE_FORMATS[stage] if f != 'auto']})"
        )
    return fmt


def read_system_prompt(path: str) -> str:
    """``data.system_prompt``: the file's text; ``""`` for no file."""
    return read_prompt_file(path, "data.system_prompt") if path else ""


def log_file_stats(stats: FileStats) -> None:
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    log.info("read %s", json.dumps(stats.summary()))
    if stats.rejected:
        log.warning(
            "%s: skipped %d record(s): %s", stats.path, sum(stats.rejected.values()), json.dumps(stats.examples)
        )


def _record_renderers(
    records: Iterator[SFTRecord], renderer: ChatRenderer, fallback_system: str
) -> Iterator[tuple[Trajectory, ChatRenderer]]:
    """Each record with a renderer for its own system prompt and tools (one per distinct pair)."""
    renderers: dict[str, ChatRenderer] = {}
    for record in records:
        system = record.system or fallback_system
        key = json.dumps([system, record.tools], sort_keys=True)
        if key not in renderers:
            renderers[key] = ChatRenderer(renderer.tokenizer, renderer.image_config, record.tools, system)
        yield record.trajectory, renderers[key]


def _osvl_records(
    path: Path, config: ImageConfig, image_cache: ImageFileCache
) -> Iterator[tuple[Trajectory, TrajectoryImages]]:
    """osvl JSONL trajectories without their pixels: each image deferred, from the store beside the file."""
    store = default_images_dir(path)

    def deferred(sha: str) -> DeferredImage:
        return image_cache.deferred(ImageFile(store / f"{sha}.png", sha), config)

    for line, data in iter_jsonl(path):
        where = f"data.train_path: {path}:{line}"
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a trajectory object")
        try:
            trajectory = trajectory_from_dict(data, store=None)
            prompt, observations = image_hashes(data)
            images = TrajectoryImages(
                [deferred(sha) for sha in prompt], [[deferred(sha) for sha in step] for step in observations]
            )
        except KeyError as error:
            raise ValueError(f"{where}: the record has no {error} field") from None
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from None
        yield trajectory, images


def load_sft_sequences(
    source: str | Path | DataConfig,
    renderer: ChatRenderer,
    stats: FileStats | None = None,
    image_cache: ImageFileCache | None = None,
) -> list[TrainSequence]:
    """Every training sequence of ``data.train_path``; ``stats`` collects a ShareGPT file's counts.
    osvl JSONL images are deferred through ``image_cache`` (a new one when not given)."""
    started = time.perf_counter()
    data = as_data_config(source)
    fmt = resolve_format(data, "sft")
    path = Path(data.train_path)
    if fmt == "text":
        stats = stats if stats is not None else FileStats(str(path))
        windows = [
            ids for text in iter_text(path, stats) for ids in text_windows(text, renderer.tokenizer, data.max_tokens)
        ]
        log_file_stats(stats)
        if not windows:
            raise ValueError(f"data.train_path: {path} holds no usable text ({dict(stats.rejected)} rejected)")
        return [text_sequence(ids, index) for index, ids in enumerate(windows)]
    renderer = renderer.with_tokenizer(CachedTokenizer(renderer.tokenizer))  # for this load only
    cache = None
    if fmt == "osvl":
        cache = image_cache if image_cache is not None else ImageFileCache()
        records = ((t, renderer, images) for t, images in _osvl_records(path, renderer.image_config, cache))
    else:
        stats = stats if stats is not None else FileStats(str(path))
        shared = iter_sharegpt(path, stats, image_root=data.image_root or None)
        pairs = _record_renderers(shared, renderer, read_system_prompt(data.system_prompt))
        records = ((t, r, None) for t, r in pairs)
    sequences = [
        train_sequence(tokenize_steps(t, r.tokenizer, keep_token_ids=True), r, reward=0.0, images=images)
        for t, r, images in records
    ]
    if stats is not None:
        log_file_stats(stats)
    if not sequences:
        rejected = f" ({dict(stats.rejected)} rejected: {stats.examples})" if stats and stats.rejected else ""
        raise ValueError(f"data.train_path: {path} holds no usable trajectories{rejected}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        headers = f", {cache.num_files} image files read to their headers" if cache is not None else ""
        log.info(
            "%s: %d sequences, %d tokens%s, laid out in %.1f s",
            path,
            len(sequences),
            sum(s.num_tokens for s in sequences),
            headers,
            time.perf_counter() - started,
        )
    return sequences


def rank_microbatches(
    sequences: list[TrainSequence],
    indices: list[int],
    max_tokens: int,
    num_ranks: int,
    rank: int,
    renderer: ChatRenderer,
) -> tuple[list[PackedBatch], int, float]:
    """This rank's micro-batches of a global batch, the global valid-token count and padding fraction."""
    chosen = [sequences[i] for i in indices]
    plan = plan_packing([s.num_tokens for s in chosen], PackingConfig(max_tokens=max_tokens, num_ranks=num_ranks))
    special = renderer.tokenizer.special
    batches = [
        with_vision_filler(b, renderer.image_config, special)
        for b in pack_rank(chosen, plan, rank, renderer.image_config, special)
    ]
    return batches, sum(s.num_valid_tokens for s in chosen), plan.padding_frac
