"""Dry-run planner: build the real model on the meta device, apply the parallel plan on a fake
process group of the target world size, and report per-rank memory. Seconds on one CPU.

    python -m osvl.parallel.plan --model qwen3_vl_30b_a3b --world-size 64 --fsdp 64 --ep 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from osvl.config.parallel import ParallelConfig
from osvl.model.config import Qwen3VLConfig
from osvl.model.presets import PRESETS, preset
from osvl.parallel.parallelize import parallel_dims, parallelize, sharded_model_config, validate_parallel

_SHARDING_DIMS = ("fsdp", "efsdp", "dp_shard")
DCP_COPY_AHEAD_BYTES = 10_000_000  # DCP's writer stages this much ahead of the file when the tensors are on a GPU
# A conversion unit gathered on the host (gloo) peaks at about this many times its bytes: the shards'
# all-gather output, its intermediate buffers and the HF conversion's copy (measured on 2 and 4 CPU ranks,
# FSDP and FSDP x TP: tests/trainer/test_policy_startup.py).
HOST_GATHER_FACTOR = 3
_BYTES = {"bfloat16": 2, "float32": 4}
GIB = 2**30
USABLE_FRACTION = 0.9  # of the GPU's memory: CUDA context, NCCL buffers and allocator fragmentation take the rest


@dataclass(frozen=True)
class HostMemory:
    """Rank 0's host memory (bytes) at the peak of each phase that moves its weights through the host:
    what its resident shards take (none when they live on the GPU) plus what the phase stages there.

    - start-up: the shards (built on meta, allocated once), plus the checkpoint pages one parameter's
      slice touches (every row of its box, full width), or the seeded init's workspace;
    - checkpoint save (DCP): the shards and AdamW state, plus one tensor staged (the largest local one);
    - HF export: the shards and AdamW state, plus the file this rank fills (its byte share, at most
      ``max_shard_bytes``) and, with the shards on the host, one conversion unit being gathered (a
      decoder layer, the embedding; ``HOST_GATHER_FACTOR`` times its bytes);
    - weight-sync bucket (``distributed``): the shards and AdamW state, plus, with the weights on the
      host, one bucket (or the one tensor larger than it) and one unit being gathered (``disk`` sync
      costs what the HF export does).
    """

    shards_on_host: bool
    sync: str  # "distributed", "disk" (an HF export per sync) or "none" (SFT)
    startup_bytes: int
    save_bytes: int
    export_bytes: int
    sync_bytes: int

    def lines(self) -> list[str]:
        where = "shards in host memory" if self.shards_on_host else "shards on the GPU"
        return [
            f"host memory per rank ({where}):",
            f"  start-up           {self.startup_bytes / GIB:10.2f} GiB",
            f"  checkpoint save    {self.save_bytes / GIB:10.2f} GiB",
            f"  HF export          {self.export_bytes / GIB:10.2f} GiB",
        ] + (
            []
            if self.sync == "none"
            else [
                f"  weight-sync bucket {self.sync_bytes / GIB:10.2f} GiB"
                + ("  (disk: an HF export)" if self.sync == "disk" else "")
            ]
        )


def host_memory(
    model: torch.nn.Module,
    *,
    world_size: int,
    shards_on_host: bool,
    pretrained: bool,
    stored_bytes: int = 2,
    export_bytes: int = 2,
    sync_bytes: int = 2,
    max_shard_bytes: int = 5 * GIB,
    bucket_bytes: int | None = 512 * 2**20,
) -> HostMemory:
    """The host side of rank 0's plan from the sharded meta model (:class:`HostMemory`). ``stored_bytes``:
    the checkpoint's element size; ``export_bytes`` / ``sync_bytes``: the export's and the sync's;
    ``bucket_bytes``: the distributed sync's bucket, None for a sync from disk, 0 for no sync (SFT)."""
    from osvl.model.checkpoint import largest_conversion_unit
    from osvl.model.init import INIT_WORKSPACE_BYTES, init_rules, local_box

    params = [param for _, param in init_rules(model).values()]
    local = sum(math.prod(local_box(p)[1]) for p in params)
    resident = 4 * local if shards_on_host else 0
    with_optimizer = 3 * resident  # AdamW's two fp32 moments beside the fp32 weights
    touched = max(local_box(p)[1][0] * math.prod(p.shape[1:]) * stored_bytes for p in params if p.dim())
    largest_local = max(4 * math.prod(local_box(p)[1]) for p in params)
    staged = largest_local if shards_on_host else largest_local + DCP_COPY_AHEAD_BYTES
    total_export = sum(p.numel() for p in params) * export_bytes
    file_buffer = min(max_shard_bytes, total_export // world_size + largest_conversion_unit(model, export_bytes))
    unit_on_host = HOST_GATHER_FACTOR * largest_conversion_unit(model, export_bytes) if shards_on_host else 0
    sync_unit = HOST_GATHER_FACTOR * largest_conversion_unit(model, sync_bytes)
    total_sync = sum(p.numel() for p in params) * sync_bytes
    bucket = max(
        min(bucket_bytes or 0, total_sync), max(p.numel() for p in params) * sync_bytes
    )  # a bigger tensor travels alone
    bucketed = with_optimizer + (bucket + sync_unit if shards_on_host else 0)
    export = with_optimizer + file_buffer + unit_on_host
    return HostMemory(
        shards_on_host=shards_on_host,
        sync="none" if bucket_bytes == 0 else "disk" if bucket_bytes is None else "distributed",
        startup_bytes=resident + (touched if pretrained else INIT_WORKSPACE_BYTES * shards_on_host),
        save_bytes=with_optimizer + staged,
        export_bytes=export,
        sync_bytes=export if bucket_bytes is None else bucketed,
    )


@dataclass(frozen=True)
class PlanReport:
    model: str
    world_size: int
    dp_shard: int
    tp: int
    ep: int
    total_params: int
    rank0_params: int
    param_bytes: int  # sharded fp32 master weights on rank 0
    grad_bytes: int
    optimizer_bytes: int  # AdamW exp_avg + exp_avg_sq, fp32
    largest_gather_name: str
    largest_gather_bytes: int  # one FSDP unit all-gathered in param dtype
    tokens_per_rank: int
    activation_bytes: int
    activation_checkpoint: str
    patches_per_rank: int = 0  # vision patches of one micro-batch
    vision_bytes: int = 0  # vision tower activations (not checkpointed)
    loss_bytes: int = 0  # fused lm_head + loss: logits chunk, hidden and lm_head gradients
    cpu_offload: bool = False  # FSDP2 keeps sharded params, grads and AdamW state in host memory
    param_dtype_bytes: int = 2
    gpu_memory_bytes: int = 0  # one GPU of the target cluster; 0 = no fit check
    max_tokens_fit: int = 0  # the most tokens per micro-batch that fit as planned (0: no fit check)
    max_tokens_fit_offload: int = 0  # the same with parallel.cpu_offload=true
    host: HostMemory | None = None  # the host side: start-up, checkpoint save, HF export, weight-sync bucket

    @property
    def steady_state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def transient_bytes(self) -> int:
        """Two units gathered (the running one and the prefetch) and one unit's fp32 gradients to reduce."""
        return 2 * self.largest_gather_bytes + self.largest_gather_bytes * 4 // self.param_dtype_bytes

    @property
    def gpu_bytes(self) -> int:
        steady = 0 if self.cpu_offload else self.steady_state_bytes
        return steady + self.transient_bytes + self.activation_bytes + self.vision_bytes + self.loss_bytes

    @property
    def usable_bytes(self) -> int:
        return int(self.gpu_memory_bytes * USABLE_FRACTION)

    @property
    def fits(self) -> bool | None:
        return None if not self.gpu_memory_bytes else self.gpu_bytes <= self.usable_bytes

    def lines(self) -> list[str]:
        offload = "  (in host memory: parallel.cpu_offload)" if self.cpu_offload else ""
        out = [
            f"model {self.model}: {self.total_params / 1e9:.2f}B params; world {self.world_size} = "
            f"dp_shard {self.dp_shard} x tp {self.tp} (ep {self.ep})",
            f"per-rank params      {self.rank0_params / 1e6:10.1f} M",
            f"param bytes (fp32)   {self.param_bytes / GIB:10.2f} GiB{offload}",
            f"grad bytes (fp32)    {self.grad_bytes / GIB:10.2f} GiB{offload}",
            f"optimizer (AdamW)    {self.optimizer_bytes / GIB:10.2f} GiB{offload}",
            f"largest all-gather   {self.largest_gather_bytes / GIB:10.2f} GiB  ({self.largest_gather_name}; "
            f"2 gathered + its fp32 grads: {self.transient_bytes / GIB:.2f} GiB)",
            f"activations          {self.activation_bytes / GIB:10.2f} GiB  "
            f"({self.tokens_per_rank} tokens/rank, AC={self.activation_checkpoint})",
            f"vision activations   {self.vision_bytes / GIB:10.2f} GiB  ({self.patches_per_rank} patches/rank, no AC)",
            f"loss buffers         {self.loss_bytes / GIB:10.2f} GiB  (fused lm_head: logits chunk, hidden and "
            f"lm_head grads)",
            f"total on GPU         {self.gpu_bytes / GIB:10.2f} GiB",
        ]
        if self.host is not None:
            out += self.host.lines()
        if self.fits is not None:
            budget = (
                f"{self.usable_bytes / GIB:.1f} GiB usable ({USABLE_FRACTION:.0%} of "
                f"{self.gpu_memory_bytes / GIB:.1f} GiB)"
            )
            out.append(f"fits: {'yes' if self.fits else 'NO'} - {self.gpu_bytes / GIB:.1f} GiB of {budget}")
            out += self.advice()
        return out

    def advice(self) -> list[str]:
        """What would make the plan fit, or how much room it leaves."""
        if self.fits:
            return [f"  up to {self.max_tokens_fit} tokens per micro-batch fit as planned"]
        lines = []
        if not self.cpu_offload:
            offloaded = self.gpu_bytes - self.steady_state_bytes
            verdict = "fits" if offloaded <= self.usable_bytes else "still does not fit"
            lines.append(
                f"  with parallel.cpu_offload=true: {offloaded / GIB:.1f} GiB ({verdict}); "
                f"up to {self.max_tokens_fit_offload} tokens per micro-batch"
            )
        lines.append(
            f"  data.max_tokens <= {self.max_tokens_fit} fits as planned (a longer trajectory cannot be "
            f"split: osvl has no context parallelism)"
        )
        return lines


def _gathered_numel(p: torch.Tensor) -> int:
    if not isinstance(p, DTensor):
        return p.numel()
    n = p.to_local().numel()
    names = p.device_mesh.mesh_dim_names or ()
    for i, placement in enumerate(p.placements):
        if isinstance(placement, (Shard, _StridedShard)) and i < len(names) and names[i] in _SHARDING_DIMS:
            n *= p.device_mesh.size(i)
    return n


def _largest_gather(model: torch.nn.Module, param_bytes: int) -> tuple[str, int]:
    units = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    best = ("", 0)
    for name, unit in units:
        nested = {id(p) for n, m in units if m is not unit and n.startswith(name) for p in m.parameters()}
        own = [p for p in unit.parameters() if id(p) not in nested]
        size = sum(_gathered_numel(p) for p in own) * param_bytes
        if size > best[1]:
            best = (name or "<root>", size)
    return best


def layer_activation_elements(arch: Qwen3VLConfig, *, tp: int) -> int:
    """Saved activations of one decoder layer per token, in elements of the parameter dtype.

    The two norms' inputs and outputs (4D); q, k, v with their QK-norm and RoPE intermediates and the
    attention output ((6Hq + 6Hkv) hd / tp, as counted from the tensors a forward saves for its backward:
    tests/parallel/test_plan.py); SwiGLU's w1, w3, silu and product (4F / tp), or,
    for MoE, the fp32 router logits and probabilities (4E) and each token's k routed copies in and out
    with their SwiGLU intermediates (k (2D + 4F_moe / tp)).
    """
    t = arch.text
    attn = (6 * t.num_attention_heads + 6 * t.num_key_value_heads) * t.head_dim // tp
    if t.is_moe:
        ffn = 4 * t.num_experts + t.num_experts_per_tok * (2 * t.hidden_size + 4 * t.moe_intermediate_size // tp)
    else:
        ffn = 4 * t.intermediate_size // tp
    return 4 * t.hidden_size + attn + ffn


def activation_bytes(arch: Qwen3VLConfig, tokens: int, *, tp: int, ac: str, dtype_bytes: int = 2) -> int:
    """Estimate of the text decoder's activations for one packed row of ``tokens``.

    Without AC every layer's activations stay (``layer_activation_elements``). With full AC only each
    layer's input (D per token; TP without sequence parallelism keeps it whole on every TP rank) is
    kept, and the backward holds one layer at a time twice over: its recomputed activations and their
    gradients.
    """
    per_layer = layer_activation_elements(arch, tp=tp) * tokens * dtype_bytes
    if ac == "full":
        return arch.text.num_hidden_layers * arch.text.hidden_size * tokens * dtype_bytes + 2 * per_layer
    return arch.text.num_hidden_layers * per_layer


def vision_activation_bytes(arch: Qwen3VLConfig, patches: int, dtype_bytes: int = 2) -> int:
    """Saved activations of the vision tower (never checkpointed) for ``patches`` patches.

    Per block and patch: the two LayerNorms' inputs and outputs, qkv and its RoPE intermediates and the
    attention output (12 H_v), the MLP's fc1 output and its GELU (2 I_v).
    """
    v = arch.vision
    return v.depth * (12 * v.hidden_size + 2 * v.intermediate_size) * patches * dtype_bytes


def loss_bytes(arch: Qwen3VLConfig, tokens: int, *, chunk: int, tp: int, stage: str, dtype_bytes: int = 2) -> int:
    """The fused lm_head + loss (no [tokens, vocab] logits ever exists): the final hidden states and
    their gradient ([tokens, D]), the lm_head gradient ([V/tp, D]) and the logits of one chunk of rows.
    GRPO's kernel keeps one [chunk, V/tp] buffer in the parameter dtype (overwritten by its gradient)
    and a parameter-dtype lm_head gradient; the SFT loss's backward holds the chunk's fp32 logits and
    softmax and an fp32 lm_head gradient."""
    if stage not in ("sft", "grpo"):
        raise ValueError(f"stage must be 'sft' or 'grpo', got {stage!r}")
    t = arch.text
    vocab = t.vocab_size // tp
    rows = min(chunk, tokens)
    logits, weight_grad = (rows * vocab * dtype_bytes, dtype_bytes) if stage == "grpo" else (2 * rows * vocab * 4, 4)
    return logits + 2 * tokens * t.hidden_size * dtype_bytes + vocab * t.hidden_size * weight_grad


def plan(
    model: str | Qwen3VLConfig,
    *,
    world_size: int,
    parallel: ParallelConfig,
    tokens_per_rank: int = 16384,
    patches_per_rank: int = 0,
    loss_chunk: int = 4096,
    stage: str = "sft",
    gpu_memory_gib: float = 0.0,
    host: dict | None = None,
) -> PlanReport:
    """Apply ``parallel`` to the meta model on a fake ``world_size`` group and measure rank 0; with
    ``gpu_memory_gib`` also say whether one micro-batch of ``tokens_per_rank`` tokens (``patches_per_rank``
    vision patches among them) fits one GPU. ``host``: the keyword arguments of :func:`host_memory`
    beyond the model and world size (``shards_on_host`` defaults to ``parallel.cpu_offload``)."""
    arch = preset(model) if isinstance(model, str) else model
    name = model if isinstance(model, str) else "custom"
    if world_size < 1 or tokens_per_rank < 1 or loss_chunk < 1:
        raise ValueError(
            f"world_size, tokens_per_rank and loss_chunk must be positive, got {world_size}, "
            f"{tokens_per_rank}, {loss_chunk}"
        )
    if patches_per_rank < 0 or gpu_memory_gib < 0:
        raise ValueError(f"patches_per_rank and gpu_memory_gib must be >= 0, got {patches_per_rank}, {gpu_memory_gib}")
    if dist.is_initialized():
        raise ValueError("plan() needs a process without a default process group (it creates a fake one)")
    validate_parallel(parallel, arch, world_size)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        dims = parallel_dims(parallel, world_size)
        dims.build_mesh()
        with torch.device("meta"):
            m = sharded_model_config(arch, parallel).build()
        total = sum(p.numel() for p in m.parameters())
        parallelize(m, dims, parallel)
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in m.parameters())
        gather_name, gather_bytes = _largest_gather(m, _BYTES[parallel.param_dtype])
        host_plan = None
        if host is not None:
            host_plan = host_memory(
                m, world_size=world_size, **{"shards_on_host": parallel.cpu_offload, "pretrained": True, **host}
            )
    finally:
        dist.destroy_process_group()
    dtype_bytes = _BYTES[parallel.param_dtype]

    def token_bytes(tokens: int) -> int:
        ac = parallel.activation_checkpoint
        return activation_bytes(arch, tokens, tp=parallel.tp, ac=ac, dtype_bytes=dtype_bytes) + loss_bytes(
            arch, tokens, chunk=loss_chunk, tp=parallel.tp, stage=stage, dtype_bytes=dtype_bytes
        )

    report = PlanReport(
        model=name,
        world_size=world_size,
        dp_shard=dims.dp_shard,
        tp=parallel.tp,
        ep=parallel.ep,
        total_params=total,
        rank0_params=local,
        param_bytes=4 * local,
        grad_bytes=4 * local,
        optimizer_bytes=8 * local,
        largest_gather_name=gather_name,
        largest_gather_bytes=gather_bytes,
        tokens_per_rank=tokens_per_rank,
        activation_bytes=activation_bytes(
            arch, tokens_per_rank, tp=parallel.tp, ac=parallel.activation_checkpoint, dtype_bytes=dtype_bytes
        ),
        activation_checkpoint=parallel.activation_checkpoint,
        patches_per_rank=patches_per_rank,
        vision_bytes=vision_activation_bytes(arch, patches_per_rank, dtype_bytes),
        loss_bytes=loss_bytes(
            arch, tokens_per_rank, chunk=loss_chunk, tp=parallel.tp, stage=stage, dtype_bytes=dtype_bytes
        ),
        cpu_offload=parallel.cpu_offload,
        param_dtype_bytes=dtype_bytes,
        gpu_memory_bytes=int(gpu_memory_gib * GIB),
        host=host_plan,
    )
    if not report.gpu_memory_bytes:
        return report
    # Memory grows linearly in tokens past the loss chunk: solve for the budget.
    slope = token_bytes(loss_chunk + 1) - token_bytes(loss_chunk)
    fixed = report.gpu_bytes - token_bytes(tokens_per_rank)

    def most_tokens(fixed_bytes: int) -> int:
        room = report.usable_bytes - fixed_bytes - token_bytes(loss_chunk)
        return loss_chunk + room // slope if room >= 0 else 0

    offloaded = fixed if parallel.cpu_offload else fixed - report.steady_state_bytes
    return dataclasses.replace(report, max_tokens_fit=most_tokens(fixed), max_tokens_fit_offload=most_tokens(offloaded))


def main(argv: list[str] | None = None) -> PlanReport:
    parser = argparse.ArgumentParser(prog="python -m osvl.parallel.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, choices=sorted(PRESETS))
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--fsdp", type=int, default=-1, help="data-parallel shard degree (-1: the rest)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=16384, help="packed tokens per rank per micro-step")
    parser.add_argument("--patches", type=int, default=0, help="vision patches per rank per micro-step")
    parser.add_argument("--loss-chunk", type=int, default=4096, help="tokens per chunk of the fused lm_head loss")
    parser.add_argument("--stage", choices=["sft", "grpo"], default="sft", help="whose loss buffers to count")
    parser.add_argument("--gpu-memory-gib", type=float, default=0.0, help="one GPU's memory: check that the plan fits")
    parser.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPU offload of params, grads, AdamW state")
    parser.add_argument("--ac", choices=["none", "full", "selective"], default="full")
    parser.add_argument("--param-dtype", choices=sorted(_BYTES), default="bfloat16")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    parallel = ParallelConfig(
        dp_shard=args.fsdp,
        tp=args.tp,
        ep=args.ep,
        activation_checkpoint=args.ac,
        param_dtype=args.param_dtype,
        cpu_offload=args.cpu_offload,
    )
    try:
        report = plan(
            args.model,
            world_size=args.world_size,
            parallel=parallel,
            tokens_per_rank=args.tokens,
            patches_per_rank=args.patches,
            loss_chunk=args.loss_chunk,
            stage=args.stage,
            gpu_memory_gib=args.gpu_memory_gib,
        )
    except ValueError as e:
        parser.error(str(e))
    print(json.dumps(asdict(report), indent=2) if args.json else "\n".join(report.lines()))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
