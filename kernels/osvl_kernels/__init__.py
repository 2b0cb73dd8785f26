"""osvl_kernels: fused fatal-aware GRPO losses over packed variable-length batches.

Depends on torch and triton only, so other trainers (verl, TRL, torchtitan) can lift it alone.
"""

from osvl_kernels.advantages import group_advantages
from osvl_kernels.grpo_loss import GRPOLossOutput, grpo_loss

__all__ = ["GRPOLossOutput", "group_advantages", "grpo_loss"]
