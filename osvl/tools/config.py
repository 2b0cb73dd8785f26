"""Typed configuration of the tool backends; pickled once into every worker process."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from osvl.tools.limits import ToolLimits


def _choice(owner: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{name} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class HttpConfig:
    timeout_s: float = 20.0  # per request
    max_retries: int = 2  # on 429 / 5xx / connection errors
    max_retry_after_s: float = 10.0  # a longer Retry-After is an outage, not a wait
    backoff_s: float = 0.5  # first wait without Retry-After; doubles per attempt

    def __post_init__(self) -> None:
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"HttpConfig.timeout_s must be positive, got {self.timeout_s}")
        if self.max_retries < 0 or self.max_retry_after_s < 0 or self.backoff_s < 0:
            raise ValueError("HttpConfig.max_retries, max_retry_after_s and backoff_s must be >= 0")


@dataclass(frozen=True)
class SuperResolutionConfig:
    backend: str = "auto"  # auto: EDSR if weights are configured, else Real-ESRGAN, else bicubic
    edsr_weights: str | None = None  # path to EDSR_x{2,4}.pb; the scale is read from the name
    threads: int = 1

    def __post_init__(self) -> None:
        _choice("SuperResolutionConfig", "backend", self.backend, ("auto", "edsr", "realesrgan", "bicubic"))
        if self.backend == "edsr" and not self.edsr_weights:
            raise ValueError("SuperResolutionConfig: backend 'edsr' needs edsr_weights")


@dataclass(frozen=True)
class OcrConfig:
    backend: str = "local"  # local: rapidocr (+ rapid-layout); paddlex: a PaddleX layout-parsing service
    layout: bool = True  # local: group lines into labelled layout blocks
    paddlex_url: str | None = None  # e.g. http://host:8080/layout-parsing
    paddlex_token: str | None = None

    def __post_init__(self) -> None:
        _choice("OcrConfig", "backend", self.backend, ("local", "paddlex"))
        if self.backend == "paddlex" and not self.paddlex_url:
            raise ValueError("OcrConfig: backend 'paddlex' needs paddlex_url")


@dataclass(frozen=True)
class TextSearchConfig:
    backend: str = "offline"  # offline: SQLite FTS5 over corpus_path; online: Serper -> Jina -> summarizer
    corpus_path: str | None = None  # JSONL with id, title, text (url optional)
    index_path: str | None = None  # SQLite file; built from the corpus when missing
    serper_url: str = "https://google.serper.dev/search"
    serper_key: str | None = None
    jina_url: str = "https://r.jina.ai/"
    jina_key: str | None = None
    summarizer_url: str | None = None  # OpenAI-compatible base URL ending in /v1
    summarizer_model: str = "Qwen3-32B"
    summarizer_key: str | None = None
    page_chars: int = 12_000  # page text given to the summarizer

    def __post_init__(self) -> None:
        _choice("TextSearchConfig", "backend", self.backend, ("offline", "online"))
        if self.backend == "online" and not (self.serper_key and self.summarizer_url):
            raise ValueError("TextSearchConfig: backend 'online' needs serper_key and summarizer_url")


@dataclass(frozen=True)
class ImageSearchConfig:
    backend: str = "offline"  # offline: near-duplicate index; online: reverse-image API
    collection_path: str | None = None  # JSONL with image (path), title, caption, page_id
    api_url: str | None = None  # reverse-image API: POST {"image_url" | "image_base64", "top_k"} -> {"results": [...]}
    api_key: str | None = None
    upload_url: str | None = None  # optional image host: POST {"image_base64"} -> {"url"}

    def __post_init__(self) -> None:
        _choice("ImageSearchConfig", "backend", self.backend, ("offline", "online"))
        if self.backend == "online" and not self.api_url:
            raise ValueError("ImageSearchConfig: backend 'online' needs api_url")


@dataclass(frozen=True)
class ToolBackendsConfig:
    limits: ToolLimits = field(default_factory=ToolLimits)
    http: HttpConfig = field(default_factory=HttpConfig)
    super_resolution: SuperResolutionConfig = field(default_factory=SuperResolutionConfig)
    ocr: OcrConfig = field(default_factory=OcrConfig)
    text_search: TextSearchConfig = field(default_factory=TextSearchConfig)
    image_search: ImageSearchConfig = field(default_factory=ImageSearchConfig)
