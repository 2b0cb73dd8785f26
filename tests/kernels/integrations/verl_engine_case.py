"""One actor update of verl 0.9.1's FSDP2 engine and of osvl's fused-lm_head subclass, on CPU, single process (gloo).

    python -m tests.kernels.integrations.verl_engine_case OUT.pt

Both engines load the same tiny random Qwen2 and run `train_batch`'s forward/backward (`forward_backward_batch`) on
the same 4-sequence batch in 2 micro-batches with verl's `partial(ppo_loss, config=actor_config)`; OUT.pt gets each
engine's per-micro-batch losses, every parameter's gradient and its metrics. Run in a process of its own: it installs
a CPU platform in verl and a global process group.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

from examples.trl_grpo import WORDS, tiny_policy  # the tiny random Qwen2 the TRL example trains

VOCAB = len(WORDS) + 2  # that policy's vocabulary: the words, pad and eos
PROMPT_LENS, RESPONSE_LENS = [3, 2, 4, 3], [6, 9, 6, 7]
FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def cpu_platform():
    """verl 0.9.1 ships CUDA, ROCm and NPU platforms only; its engine asks the platform for the device, the
    communication backend and memory figures. This one answers for the CPU."""
    from verl.plugin.platform.platform_base import PlatformBase

    def zero(*args):
        return 0

    class CpuPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = types.SimpleNamespace(
            mem_get_info=lambda *args: (0, 0),
            memory_allocated=zero,
            memory_reserved=zero,
            max_memory_allocated=zero,
            max_memory_reserved=zero,
            empty_cache=lambda: None,
            synchronize=lambda *args: None,
            is_available=lambda: True,
            current_device=zero,
            device_count=lambda: 1,
            manual_seed=torch.manual_seed,
            manual_seed_all=torch.manual_seed,
        )

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def set_device(self, index):
            pass

        def synchronize(self, index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, index=0):
            return (None, None)

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CPU_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    return CpuPlatform()


def build(engine_class, path: str):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    # sdpa: flash-attention is CUDA-only; transformers reads the packed sequences' boundaries from position_ids
    model = HFModelConfig(
        path=path, load_tokenizer=False, use_remove_padding=True, override_config={"attn_implementation": "sdpa"}
    )
    model.model_type = "language_model"
    engine = engine_class(
        model_config=model,
        engine_config=FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, mixed_precision=FP32),
        optimizer_config=FSDPOptimizerConfig(lr=1e-3),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def actor_config(loss_mode: str = "vanilla"):
    from verl.workers.config import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    return ActorConfig(
        strategy="fsdp2",
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        rollout_n=1,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode="seq-mean-token-mean",
        use_kl_loss=True,
        kl_loss_type="low_var_kl",
        kl_loss_coef=0.05,
        entropy_coeff=0.01,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
    )


def batch():
    """What verl's actor update hands its engine: a no-padding batch (nested tensors) with its engine keys."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(1)

    def nested(rows):
        return torch.nested.as_nested_tensor(rows, layout=torch.jagged)

    lens = list(zip(PROMPT_LENS, RESPONSE_LENS))
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in PROMPT_LENS]
    responses = [torch.randint(0, VOCAB, (n,), generator=g) for n in RESPONSE_LENS]
    data = TensorDict(
        {
            "input_ids": nested([torch.cat([p, r]) for p, r in zip(prompts, responses)]),
            "position_ids": nested([torch.arange(p + r) for p, r in lens]),
            "prompts": nested(prompts),
            "responses": nested(responses),
            "loss_mask": nested(
                [torch.cat([torch.zeros(p), torch.ones(r)]) for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]
            ),
            "response_mask": nested([torch.ones(n, dtype=torch.long) for n in RESPONSE_LENS]),
            "old_log_probs": nested([-torch.rand(n, generator=g) * 2 - 2.5 for n in RESPONSE_LENS]),
            "ref_log_prob": nested([-torch.rand(n, generator=g) * 2 - 2.5 for n in RESPONSE_LENS]),
            "advantages": nested([torch.full((n,), a) for n, a in zip(RESPONSE_LENS, [1.0, -0.5, 0.8, -1.2])]),
        },
        batch_size=[len(PROMPT_LENS)],
    )
    tu.assign_non_tensor(
        data,
        temperature=1.0,
        global_batch_size=len(PROMPT_LENS),
        use_remove_padding=True,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,
        use_fused_kernels=False,
        calculate_entropy=True,
    )
    return data


def update(engine, config) -> dict:
    from verl.utils.metric.utils import Metric
    from verl.workers.utils.losses import ppo_loss

    engine.optimizer_zero_grad()
    with engine.train_mode():  # which zeroes the gradients on leaving
        out = engine.forward_backward_batch(batch(), functools.partial(ppo_loss, config=config))
        grads = {name: p.grad.full_tensor().clone() for name, p in engine.module.named_parameters()}
    metrics = {key: m.aggregate() for key, m in out["metrics"].items() if isinstance(m, Metric)}
    return {"losses": out["loss"], "grads": grads, "metrics": metrics}


def main(out_path: str) -> None:
    from verl.plugin.platform.platform_manager import set_platform

    set_platform(cpu_platform())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    import verl.models.transformers.monkey_patch as monkey_patch
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from osvl_kernels.integrations.verl_engine import fused_engine_class

    # TRL 1.16 is importable here and lacks the value-head class verl's patcher imports: fused_engine_class() tells
    # the patcher so; verl's own engine below is built after it, in the same process
    fused = fused_engine_class()
    assert not monkey_patch.is_trl_available()
    path = tiny_policy(Path(out_path).parent / "tiny_policy")
    results = {}
    for name, engine_class in (("verl", FSDPEngineWithLMHead), ("osvl", fused)):
        results[name] = update(build(engine_class, path), actor_config())
    try:
        update(build(fused, path), actor_config("gspo"))
    except ValueError as refused:
        results["refused"] = str(refused)
    torch.save(results, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
