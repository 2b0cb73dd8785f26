"""Readers for outside datasets: the released SearchVL SFT (ShareGPT) and RL (parquet) files."""

from osvl.data.formats.detect import detect_format
from osvl.data.formats.plain_text import iter_text, text_windows
from osvl.data.formats.processor import PREPROCESSOR_FILE, checkpoint_image_config
from osvl.data.formats.records import (
    FileStats,
    Rejected,
    decode_image_bytes,
    load_image_file,
)
from osvl.data.formats.rl_parquet import iter_rl_parquet, rl_prompt
from osvl.data.formats.sharegpt import (
    SFTRecord,
    ShareGPTColumns,
    iter_sharegpt,
    sharegpt_record,
    tokenize_steps,
)

__all__ = [
    "PREPROCESSOR_FILE",
    "FileStats",
    "Rejected",
    "SFTRecord",
    "ShareGPTColumns",
    "checkpoint_image_config",
    "decode_image_bytes",
    "detect_format",
    "iter_rl_parquet",
    "iter_sharegpt",
    "iter_text",
    "load_image_file",
    "rl_prompt",
    "sharegpt_record",
    "text_windows",
    "tokenize_steps",
]
