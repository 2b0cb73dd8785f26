"""Adapters that let other trainers call osvl's fused GRPO losses.

Each host framework is imported only by its own module (`verl`, `trl`, `torchtitan`), and `verl`
only inside `register_verl()`, so `import osvl_kernels` never needs any of them. `padded` holds the
[B, L] <-> packed conversion the padded trainers share.
"""

from osvl_kernels.integrations.padded import PackedLayout, pack, pack_layout, unpack

__all__ = ["PackedLayout", "pack", "pack_layout", "unpack"]
