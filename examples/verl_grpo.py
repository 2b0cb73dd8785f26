"""Fatal-aware GRPO in verl 0.9 with osvl's estimator and loss.

In a verl job (GPUs, Ray, an inference engine), the complete configuration is::

    VERL_USE_EXTERNAL_MODULES=osvl_kernels.integrations.verl_plugin \\
    python -m verl.trainer.main_ppo $(python examples/verl_grpo.py --print-overrides) \\
        data.train_files=... actor_rollout_ref.model.path=...

`compute_score` below is the reward function those overrides name: it returns the fatal flag
beside the score, and the "osvl_fatal_sync" trainer hands the flags to the "osvl_fatal_grpo"
estimator. Run without arguments, this script runs on CPU what verl would call, on a tiny random
policy: the reward function, the advantage step (estimator + flags), and one actor loss computed
by verl's own `ppo_loss` (loss_mode=osvl_fatal_grpo, full-vocab log-probs) and by osvl's fused
loss from the final hidden states (`verl_fused_ppo_loss`), which agree. In a verl job, adding
`osvl_kernels.integrations.verl_engine_plugin` to VERL_USE_EXTERNAL_MODULES (comma-separated) makes the actor's
FSDP engine compute that fused loss in its update (docs/integrations.md; tested in test_verl_engine.py).
"""

from __future__ import annotations

import argparse
import re

import numpy as np
import torch

FATAL_CONSECUTIVE_ERRORS = 3  # the paper's K: three tool errors in a row end a trajectory
VERL_OVERRIDES = [
    "trainer.use_v1=true",
    "trainer.v1.trainer_mode=osvl_fatal_sync",  # reads reward_extra_info['osvl_fatal'] before the advantage step
    "algorithm.adv_estimator=osvl_fatal_grpo",  # group z-score + one-sided clamp of fatal samples
    "algorithm.norm_adv_by_std_in_grpo=true",  # false: Dr.GRPO (no std division)
    "reward.custom_reward_function.path=examples/verl_grpo.py",
    "reward.custom_reward_function.name=compute_score",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.actor.policy_loss.loss_mode=osvl_fatal_grpo",
    "actor_rollout_ref.actor.clip_ratio_low=0.2",
    "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "actor_rollout_ref.actor.clip_ratio_c=3.0",  # dual clip, negative advantages only
    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",  # any of verl's five modes
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",  # k3 clamped at 10 (k3 / low_var_kl only)
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
]
_TOOL_RESPONSE = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.S)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **unused) -> dict:
    """verl reward function: exact-match answer score, and `osvl_fatal` when the trajectory made
    FATAL_CONSECUTIVE_ERRORS tool calls in a row that failed (tool responses starting "Error";
    adapt `tool_failed` to your tools)."""
    answer = re.search(r"<answer>(.*?)</answer>", solution_str, re.S)
    score = float(answer is not None and answer.group(1).strip() == str(ground_truth).strip())
    run = longest = 0
    for response in _TOOL_RESPONSE.findall(solution_str):
        run = run + 1 if tool_failed(response) else 0
        longest = max(longest, run)
    return {"score": score, "osvl_fatal": longest >= FATAL_CONSECUTIVE_ERRORS}


def tool_failed(response: str) -> bool:
    return response.startswith("Error")


def example_rollouts() -> list[str]:
    ok = "<tool_call>search</tool_call><tool_response>Paris is the capital</tool_response>"
    err = "<tool_call>search</tool_call><tool_response>Error: timeout</tool_response>"
    return [
        ok + "<answer>Paris</answer>",
        err + err + err,  # fatal: three failed calls in a row, no answer
        ok + "<answer>Lyon</answer>",
        err + ok + "<answer>Paris</answer>",
    ]


def advantages(scores: list[dict], response_mask: torch.Tensor) -> torch.Tensor:
    """verl's advantage step as the osvl_fatal_<mode> trainer runs it: flags from each sample's
    reward_extra_info, then the registered estimator with the arguments verl passes."""
    from verl.trainer.ppo import core_algos

    from osvl_kernels.integrations.verl import ADV_ESTIMATOR_NAME, fatal_flags, fatal_flags_from_extra_fields

    flags = fatal_flags_from_extra_fields([{"reward_extra_info": s} for s in scores])
    token_rewards = torch.zeros(response_mask.shape)
    last = response_mask.sum(-1) - 1
    token_rewards[torch.arange(len(scores)), last] = torch.tensor([s["score"] for s in scores])
    with fatal_flags(flags):
        adv, _ = core_algos.get_adv_estimator_fn(ADV_ESTIMATOR_NAME)(
            token_level_rewards=token_rewards,
            response_mask=response_mask,
            config=None,
            index=np.array(["q0"] * len(scores), dtype=object),
        )
    return adv


def micro_batch(prompt_lens, response_lens, advantages: torch.Tensor, vocab: int, seed: int = 0):
    """A verl no-padding micro-batch (what the engine hands ppo_loss) for random token ids."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(seed)

    def nested(rows):
        return torch.nested.as_nested_tensor(rows, layout=torch.jagged)

    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in prompt_lens]
    responses = [torch.randint(0, vocab, (n,), generator=g) for n in response_lens]
    data = TensorDict(
        {
            "input_ids": nested([torch.cat([p, r]) for p, r in zip(prompts, responses)]),
            "prompts": nested(prompts),
            "responses": nested(responses),
            "response_mask": nested([torch.ones(n, dtype=torch.long) for n in response_lens]),
            "old_log_probs": nested([-torch.rand(n, generator=g) * 3 for n in response_lens]),
            "advantages": nested([advantages[i, :n] for i, n in enumerate(response_lens)]),
            "ref_log_prob": nested([-torch.rand(n, generator=g) * 3 for n in response_lens]),
        },
        batch_size=[len(prompt_lens)],
    )
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None, temperature=1.0)
    return data


def actor_loss_both_ways(data, hidden: torch.Tensor, lm_head: torch.Tensor) -> dict:
    """One actor loss by verl's ppo_loss on full-vocab log-probs and by the fused loss."""
    from verl.workers.config import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss

    from osvl_kernels.integrations.verl import POLICY_LOSS_NAME, verl_fused_ppo_loss

    def config():
        return ActorConfig(
            strategy="fsdp",
            ppo_mini_batch_size=4,
            ppo_micro_batch_size_per_gpu=4,
            rollout_n=4,
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
            clip_ratio_c=3.0,
            loss_agg_mode="seq-mean-token-mean",
            use_kl_loss=True,
            kl_loss_type="low_var_kl",
            kl_loss_coef=0.001,
            policy_loss=PolicyLossConfig(loss_mode=POLICY_LOSS_NAME),
        )

    w_verl = lm_head.clone().requires_grad_()
    logits = hidden @ w_verl.T
    rolled = torch.roll(data["input_ids"].values(), -1)
    log_probs = torch.log_softmax(logits, -1).gather(1, rolled[:, None])[:, 0]
    verl_loss, _ = ppo_loss(config(), {"log_probs": log_probs}, data)
    verl_loss.backward()
    w_fused = lm_head.clone().requires_grad_()
    fused_loss, metrics = verl_fused_ppo_loss(config(), hidden, w_fused, data)
    fused_loss.backward()
    return {
        "verl_loss": verl_loss.detach(),
        "fused_loss": fused_loss.detach(),
        "verl_grad": w_verl.grad,
        "fused_grad": w_fused.grad,
        "metrics": metrics,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print-overrides", action="store_true", help="print the verl Hydra overrides and exit")
    args = parser.parse_args(argv)
    if args.print_overrides:
        print(" ".join(VERL_OVERRIDES))
        return {"overrides": VERL_OVERRIDES}
    import osvl_kernels.integrations.verl_plugin  # noqa: F401  (what VERL_USE_EXTERNAL_MODULES imports)

    scores = [compute_score("demo", text, "Paris") for text in example_rollouts()]
    response_lens = [6, 9, 6, 7]
    mask = torch.arange(9)[None] < torch.tensor(response_lens)[:, None]
    adv = advantages(scores, mask)
    data = micro_batch([3, 2, 4, 3], response_lens, adv, vocab=32)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(int(data["input_ids"].offsets()[-1]), 16, generator=g)
    result = actor_loss_both_ways(data, hidden, torch.randn(32, 16, generator=g) * 0.3)
    for s, a in zip(scores, adv[:, 0].tolist()):
        print(f"score {s['score']:.0f}  fatal {s['osvl_fatal']!s:<5}  advantage {a:+.3f}")
    print(f"actor loss: verl ppo_loss {result['verl_loss']:.6f}, osvl fused {result['fused_loss']:.6f}")
    return {"scores": scores, "advantages": adv, **result}


if __name__ == "__main__":
    main()
