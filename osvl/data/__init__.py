"""Trajectories to model inputs: tokenizer, image processor, chat renderer, MRoPE, packer."""

from osvl.data.balance import first_fit_decreasing, karmarkar_karp
from osvl.data.chat import ChatRenderer, RenderedSequence, Segment, function_schema, system_text
from osvl.data.distributed import GlobalNormalizers, global_normalizers
from osvl.data.image import ImageConfig, ProcessedImage, decode_image, pixel_values, process_image, smart_resize
from osvl.data.mrope import mrope_position_ids
from osvl.data.packing import (
    PackedBatch,
    PackingConfig,
    PackPlan,
    TrainSequence,
    pack_microbatch,
    pack_rank,
    plan_packing,
    train_sequence,
)
from osvl.data.tokenizer import SpecialTokens, Tokenizer, load_tokenizer, train_bpe_tokenizer

__all__ = [
    "ChatRenderer",
    "GlobalNormalizers",
    "ImageConfig",
    "PackPlan",
    "PackedBatch",
    "PackingConfig",
    "ProcessedImage",
    "RenderedSequence",
    "Segment",
    "SpecialTokens",
    "Tokenizer",
    "TrainSequence",
    "decode_image",
    "first_fit_decreasing",
    "function_schema",
    "global_normalizers",
    "karmarkar_karp",
    "load_tokenizer",
    "mrope_position_ids",
    "pack_microbatch",
    "pack_rank",
    "pixel_values",
    "plan_packing",
    "process_image",
    "smart_resize",
    "system_text",
    "train_bpe_tokenizer",
    "train_sequence",
]
