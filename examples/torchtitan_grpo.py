"""osvl's GRPO loss as the loss of torchtitan 0.3.0's RL trainer (experiments/rl).

In a torchtitan RL config (e.g. a copy of experiments/rl/examples/alphabet_sort/config_registry.py),
replace the policy trainer's loss::

    from osvl_kernels.integrations.torchtitan import OsvlGRPOLoss

    PolicyTrainer.Config(
        loss=ChunkedLossWrapper.Config(
            num_chunks=8, loss_fn=OsvlGRPOLoss.Config(eps_low=0.2, eps_high=0.28, dual_clip=3.0)
        ),
        ...
    )

torchtitan's PolicyTrainer calls `loss_fn(pred, labels, global_valid_tokens, generator_logprobs=,
advantages=, loss_mask=)`; with ChunkedLossWrapper, `pred` is the final hidden state and each
chunk's logits reach osvl's loss in turn. Run without arguments, this script makes that call on
CPU with a tiny lm_head and a packed micro-batch like torchtitan's, and checks it against
`grpo_loss` on the whole batch.
"""

from __future__ import annotations

import argparse

import torch

LOSS_CONFIG = dict(eps_low=0.2, eps_high=0.28, dual_clip=3.0, entropy_coef=0.0, temperature=1.0)


def packed_micro_batch(seed: int = 0, B: int = 2, L: int = 16, H: int = 16, V: int = 48) -> dict:
    """What torchtitan's PolicyTrainer hands its loss: samples packed back to back per row,
    a loss mask over generated tokens, the generator's log-probs and per-token advantages."""
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.rand(B, L, generator=g) < 0.7
    advantages = torch.randn(B, L, generator=g) * loss_mask
    return dict(
        hidden=torch.randn(B, L, H, generator=g),
        lm_head=torch.nn.Linear(H, V, bias=False),
        labels=torch.randint(0, V, (B, L), generator=g),
        generator_logprobs=-torch.rand(B, L, generator=g) * 3 - 0.5,
        advantages=advantages,
        loss_mask=loss_mask,
        global_valid_tokens=loss_mask.sum().float(),
    )


def chunked_loss_step(batch: dict, num_chunks: int = 4) -> dict:
    """One loss + backward through torchtitan's ChunkedLossWrapper around OsvlGRPOLoss."""
    from torchtitan.components.loss import ChunkedLossWrapper

    from osvl_kernels.integrations.torchtitan import OsvlGRPOLoss

    loss_fn = ChunkedLossWrapper.Config(num_chunks=num_chunks, loss_fn=OsvlGRPOLoss.Config(**LOSS_CONFIG)).build()
    loss_fn.set_lm_head(batch["lm_head"])
    hidden = batch["hidden"].clone().requires_grad_()
    loss, metrics = loss_fn(
        hidden,
        batch["labels"],
        batch["global_valid_tokens"],
        generator_logprobs=batch["generator_logprobs"],
        advantages=batch["advantages"],
        loss_mask=batch["loss_mask"],
    )
    loss.backward()
    return {
        "loss": loss.detach(),
        "metrics": metrics,
        "grad_hidden": hidden.grad,
        "grad_lm_head": batch["lm_head"].weight.grad.clone(),
    }


def whole_batch_reference(batch: dict) -> dict:
    """The same objective by grpo_loss on the full [B*L, V] logits: token-mean over the global count."""
    from osvl_kernels import grpo_loss

    B, L, _ = batch["hidden"].shape
    hidden = batch["hidden"].clone().requires_grad_()
    weight = batch["lm_head"].weight.detach().clone().requires_grad_()
    out = grpo_loss(
        (hidden @ weight.T).reshape(B * L, -1),
        batch["labels"].reshape(-1),
        torch.arange(0, B * L + 1, L, dtype=torch.int32),
        batch["loss_mask"].reshape(-1),
        old_logprobs=batch["generator_logprobs"].reshape(-1),
        advantages=batch["advantages"].reshape(-1),
        eps_low=LOSS_CONFIG["eps_low"],
        eps_high=LOSS_CONFIG["eps_high"],
        dual_clip=LOSS_CONFIG["dual_clip"],
        loss_agg="token-mean",
        num_tokens=batch["global_valid_tokens"],
    )
    out.loss.backward()
    return {"loss": out.loss.detach(), "grad_hidden": hidden.grad, "grad_lm_head": weight.grad}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args(argv)
    batch = packed_micro_batch()
    got = chunked_loss_step(batch, args.chunks)
    expected = whole_batch_reference(batch)
    print(
        f"ChunkedLossWrapper(OsvlGRPOLoss) loss {got['loss']:.6f}; grpo_loss on the whole batch {expected['loss']:.6f}"
    )
    return {"chunked": got, "whole": expected}


if __name__ == "__main__":
    main()
