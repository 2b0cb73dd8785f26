"""The MoE router losses of a training stage, and their per-step metrics.

Normalisation over ranks and micro-batches: a micro-batch of ``n`` real tokens weighs ``n / N`` in
the load-balance term and each token ``1 / N`` in the z-loss term, ``N`` being the real tokens of the
optimizer step over all data-parallel ranks. Gradients are summed over data-parallel ranks (as for
the main loss), so the step optimises the token-weighted mean over micro-batches of each layer's
balance loss, plus the mean over the step's tokens of the z-loss, summed over MoE layers. The
expert counts of one micro-batch are never reduced across ranks: each packed micro-batch is balanced
on its own, as Megatron-Core's default ``aux_loss`` balances each micro-batch.

Real tokens are a packed row's documents; the filler documents that keep ranks in step are excluded.
The experts are dropless (torchtitan's token dispatch has no capacity limit): no token is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from osvl.config.recipe import MoEConfig
from osvl.data.distributed import rank_device
from osvl.data.packing import PackedBatch
from osvl.model.moe_losses import load_cv
from osvl.model.router import Qwen3VLRouter, RouterLossInputs


def routed_tokens(batch: PackedBatch) -> int:
    """Tokens of the batch's real documents, which precede any filler document."""
    return int(batch.cu_seqlens[batch.num_seqs])


def _world_sum(values: torch.Tensor) -> torch.Tensor:
    """The sum over ranks, on the host."""
    if dist.is_available() and dist.is_initialized():
        values = values.to(rank_device())
        dist.all_reduce(values)
    return values.cpu()


class RouterLosses:
    """Sets each micro-batch's ``RouterLossInputs`` on the model's routers and sums their statistics.

    ``tp``: tensor-parallel ranks route the same tokens, so sums over the world are divided by it.
    A dense model has no routers: every call is then a no-op and ``metrics()`` is empty.
    """

    def __init__(self, model: torch.nn.Module, config: MoEConfig, tp: int = 1):
        self.routers = [m for m in model.modules() if isinstance(m, Qwen3VLRouter)]
        self.config, self.tp = config, tp
        self._step_tokens = 0
        self._pending = False
        self._reset()

    def _reset(self) -> None:
        experts = self.routers[0].num_experts if self.routers else 0
        self._counts = torch.zeros(len(self.routers), experts, dtype=torch.float64)
        self._balance = torch.zeros(len(self.routers), dtype=torch.float64)  # sum of n * balance
        self._z = torch.zeros(len(self.routers), dtype=torch.float64)
        self._tokens = 0

    def start(self, batches: Sequence[PackedBatch]) -> None:
        """Before an optimizer step's micro-batches: one all-reduce of the step's real tokens."""
        if not self.routers:
            return
        local = torch.tensor([float(sum(routed_tokens(b) for b in batches))], dtype=torch.float64)
        self._step_tokens = round(float(_world_sum(local)[0]) / self.tp)

    def prepare(self, batch: PackedBatch) -> None:
        """Before a micro-batch's forward (after the previous one's backward)."""
        if not self.routers:
            return
        self._collect()
        inputs = RouterLossInputs(
            aux_coef=self.config.aux_loss_coef,
            z_coef=self.config.z_loss_coef,
            routed_tokens=routed_tokens(batch),
            step_tokens=max(self._step_tokens, 1),
        )
        for router in self.routers:
            router.loss_inputs = inputs
            router.stats = None
        self._pending = True

    def idle(self) -> None:
        """Before forwards that train nothing (the old policy's log-probs): no losses, no statistics."""
        self._collect()
        for router in self.routers:
            router.loss_inputs = None

    def _collect(self) -> None:
        if not self._pending:
            return
        stats = [router.stats for router in self.routers]
        if any(s is None for s in stats):
            raise RuntimeError("a router did not run in the micro-batch's forward")
        layers = (
            torch.cat(
                [
                    torch.stack([s.counts for s in stats]),
                    torch.stack([s.balance for s in stats]).unsqueeze(1),
                    torch.stack([s.z_sum for s in stats]).unsqueeze(1),
                ],
                dim=1,
            )
            .double()
            .cpu()
        )
        tokens = stats[0].tokens
        self._counts += layers[:, :-2]
        self._balance += layers[:, -2] * tokens
        self._z += layers[:, -1]
        self._tokens += tokens
        self._pending = False

    def metrics(self) -> dict[str, float]:
        """The step's metrics (collective: every rank calls it), averaged over MoE layers:
        ``moe_aux_loss`` token-weighted balance loss (1.0 = uniform; before the coefficient),
        ``moe_z_loss`` mean squared router logsumexp, ``moe_load_cv`` / ``moe_load_cv_max`` the
        coefficient of variation of the step's expert loads (mean and worst layer)."""
        if not self.routers:
            return {}
        self._collect()
        packed = torch.cat([self._counts.flatten(), self._balance, self._z, torch.tensor([float(self._tokens)])])
        total = _world_sum(packed) / self.tp
        layers, experts = self._counts.shape
        counts = total[: layers * experts].view(layers, experts)
        balance, z = total[layers * experts : -1].view(2, layers)
        tokens = max(float(total[-1]), 1.0)
        cv = load_cv(counts)
        self._reset()
        return {
            "moe_aux_loss": float(balance.mean()) / tokens,
            "moe_z_loss": float(z.mean()) / tokens,
            "moe_load_cv": float(cv.mean()),
            "moe_load_cv_max": float(cv.max()),
        }
