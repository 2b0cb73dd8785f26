"""verl (0.9.x) FSDP engine whose actor update computes verl's `ppo_loss` from the final hidden states.

verl's `FSDPEngineWithLMHead.forward_step` runs the whole model, turns its [T, V] logits into log-probs and hands them
to the loss function, so no configuration key lets a loss see the hidden states. `fused_engine_class(base)` subclasses
that engine: when the loss function is verl's own `partial(ppo_loss, config=actor_config)` (the actor's update), the
model still runs through `self.module(...)` as verl runs it (FSDP's unshard/reshard hooks, verl's remove-padding
patches and multimodal inputs all stay verl's), but for that call the lm_head module's forward is
`verl_fused_ppo_loss`: it receives the final hidden states [1, T, H] and returns the loss, computed by
`linear_grpo_loss` a chunk of tokens at a time, so [T, V] logits never exist. Log-prob passes (old and reference
log-probs, `forward_only`) and any other loss function run verl's own step unchanged.

`register_fused_engine()` puts the subclass in verl's engine registry in place of the FSDP/FSDP2 language-model
engines; the plugin module `verl_engine_plugin` calls it in every verl process
(`VERL_USE_EXTERNAL_MODULES=osvl_kernels.integrations.verl_plugin,osvl_kernels.integrations.verl_engine_plugin`).

What it refuses, each with a ValueError naming the setting: Ulysses sequence parallelism (the hidden states would be
a shard of the sequence), `use_remove_padding=False`, verl's own fused kernels (`model.use_fused_kernels`: its
forward never calls the lm_head), policy loss modes other than "vanilla" and "osvl_fatal_grpo", an lm_head bias, and
models whose forward changes what the lm_head returns (logit soft-capping or scaling). Nothing here imports verl
until a function runs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch

from osvl_kernels.integrations.verl import POLICY_LOSS_NAME, verl_fused_ppo_loss

# Policy losses whose semantics the fused loss reproduces (verl's vanilla PPO clip with dual clip, and osvl's).
FUSED_LOSS_MODES = ("vanilla", POLICY_LOSS_NAME)


def ppo_loss_config(loss_function: Any) -> Any | None:
    """The actor config when `loss_function` is verl's `partial(ppo_loss, config=...)`, else None."""
    from verl.workers.utils.losses import ppo_loss

    if isinstance(loss_function, functools.partial) and loss_function.func is ppo_loss:
        return loss_function.keywords["config"]
    return None


@contextlib.contextmanager
def computed_by(module: torch.nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """`module` computes `forward` instead of its own forward while the context is open; its hooks (FSDP's) still
    run around the call, as around any forward."""
    module.forward = forward
    try:
        yield
    finally:
        del module.forward


def skip_missing_value_head_patch() -> None:
    """verl 0.9's model patching imports TRL's `AutoModelForCausalLMWithValueHead` whenever TRL is importable, and
    TRL >= 1.0 no longer has it: with both installed (``osvl-kernels[trl,verl]``) building any actor raised
    ImportError. When the class is missing, tell verl's patcher that TRL is absent (there is nothing of TRL's to
    patch); with an older TRL, or without TRL, leave verl as it is."""
    import verl.models.transformers.monkey_patch as monkey_patch

    if not monkey_patch.is_trl_available():
        return
    try:
        from trl.experimental.ppo import AutoModelForCausalLMWithValueHead  # noqa: F401
    except ImportError:
        try:
            from trl import AutoModelForCausalLMWithValueHead  # noqa: F401
        except ImportError:
            monkey_patch.is_trl_available = lambda: False


@functools.cache
def fused_engine_class(base: type | None = None) -> type:
    """A subclass of verl's `FSDPEngineWithLMHead` (or of `base`, one of its subclasses) whose actor update is the
    fused loss. One class per base."""
    skip_missing_value_head_patch()
    if base is None:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead as base

    class OsvlFusedLMHeadEngine(base):
        osvl_fused = True

        def forward_step(self, micro_batch: Any, loss_function: Any, forward_only: bool) -> tuple[torch.Tensor, dict]:
            config = None if forward_only else ppo_loss_config(loss_function)
            if config is None:
                return super().forward_step(micro_batch, loss_function=loss_function, forward_only=forward_only)
            return self.fused_forward_step(micro_batch, config)

        def fused_forward_step(self, micro_batch: Any, config: Any) -> tuple[torch.Tensor, dict]:
            from verl.utils.device import get_device_id, get_device_name
            from verl.utils.metric.utils import AggregationType, Metric

            self.check_fusable(micro_batch, config)
            micro_batch = micro_batch.to(get_device_id())
            model_inputs, output_args = self.prepare_model_inputs(micro_batch=micro_batch)
            pad = output_args.get("pad_size", 0)  # pad_to_length's static tail of the packed sequence
            lm_head = getattr(self.module, "module", self.module).get_output_embeddings()
            if lm_head.bias is not None:
                raise ValueError("lm_head bias is not supported by linear_grpo_loss")
            computed = {}

            def fused_lm_head(hidden: torch.Tensor) -> torch.Tensor:
                hidden = hidden.squeeze(0)
                hidden = hidden[: hidden.shape[0] - pad]
                weight = lm_head.weight  # unsharded by FSDP's pre-forward hook for this call
                # under autocast verl's lm_head multiplies in the autocast dtype; the fused loss wants one dtype
                loss, metrics = verl_fused_ppo_loss(config, hidden, weight.to(hidden.dtype), micro_batch)
                computed.update(loss=loss, metrics=metrics)
                return loss

            dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
            autocast = nullcontext() if dtype == torch.float32 else torch.autocast(get_device_name(), dtype=dtype)
            with autocast, computed_by(lm_head, fused_lm_head):
                output = self.module(**model_inputs, use_cache=False)
            loss = computed.get("loss")
            if loss is None or getattr(output, "logits", None) is not loss:
                raise ValueError(
                    "the model's forward did not hand the lm_head's output back as its logits (verl's fused kernels, "
                    "logit soft-capping or scaling): the fused loss cannot replace its lm_head"
                )
            metrics = {
                key: Metric(AggregationType.MEAN, value.detach().float()) for key, value in computed["metrics"].items()
            }
            return loss, {"model_output": {}, "loss": loss.detach().item(), "metrics": metrics}

        def check_fusable(self, micro_batch: Any, config: Any) -> None:
            from verl.utils import tensordict_utils as tu

            if self.use_ulysses_sp:
                raise ValueError("the fused loss needs ulysses_sequence_parallel_size=1 (whole sequences per rank)")
            if not tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
                raise ValueError("the fused loss needs model.use_remove_padding=True (verl's packed layout)")
            if tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False):
                raise ValueError("model.use_fused_kernels=True replaces the lm_head call the fused loss takes over")
            mode = config.policy_loss.get("loss_mode", "vanilla")
            if mode not in FUSED_LOSS_MODES:
                raise ValueError(f"actor.policy_loss.loss_mode={mode!r}: the fused loss computes {FUSED_LOSS_MODES}")

    OsvlFusedLMHeadEngine.__name__ = OsvlFusedLMHeadEngine.__qualname__ = f"OsvlFused{base.__name__}"
    return OsvlFusedLMHeadEngine


def register_fused_engine(backends: tuple[str, ...] = ("fsdp", "fsdp2")) -> list[type]:
    """Swap the fused subclass in for every language-model engine registered under `backends` (idempotent); returns
    the classes now registered. verl's `EngineRegistry.register` refuses a key twice, so the entries are replaced
    in its table directly."""
    from verl.workers.engine.base import EngineRegistry

    engines = EngineRegistry._engines["language_model"]
    for backend in backends:
        for key, cls in list(engines[backend].items()):
            if not getattr(cls, "osvl_fused", False):
                engines[backend][key] = fused_engine_class(cls)
    return [cls for backend in backends for cls in engines[backend].values()]
