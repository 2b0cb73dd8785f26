"""osvl: a kernel-centric trainer for multimodal deep-search agents (OpenSearch-VL recipe)."""

__version__ = "0.1.0"
