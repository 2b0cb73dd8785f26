"""osvl_kernels: fused fatal-aware GRPO losses over packed variable-length batches.

Depends on torch and triton only, so other trainers (verl, TRL, torchtitan) can lift it alone.
"""

from osvl_kernels.advantages import group_advantages
from osvl_kernels.grpo_loss import GRPOLossOutput, grpo_loss
from osvl_kernels.importance import RolloutCorrection
from osvl_kernels.linear_grpo_loss import linear_grpo_loss
from osvl_kernels.loss_config import GRPOLossConfig
from osvl_kernels.token_logprobs import linear_token_logprobs, token_logprobs

__all__ = ["GRPOLossConfig", "GRPOLossOutput", "RolloutCorrection", "group_advantages", "grpo_loss"]
__all__ += ["linear_grpo_loss", "linear_token_logprobs", "token_logprobs"]
