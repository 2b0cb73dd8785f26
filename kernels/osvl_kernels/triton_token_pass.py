"""Triton kernels of the token pass; token_pass.py holds the contract and the torch twin.

One program per packed row (1-D grid over tokens). A live row is streamed twice in BLOCK_V
tiles: the first sweep keeps the online log-sum-exp statistics (running max, sum of exp, sum of
exp * z' for the entropy) with one exp per element; the GRPO token scalars are then computed in
registers and the second sweep writes the closed-form gradient. A row whose weight is 0 reads
nothing but its weight.

All math is fp32 on z' = logits * (1 / temperature); offsets into [T, V] are int64, so
T * V >= 2^31 is addressable. The vocab dimension must have unit stride in the gradient
buffer (logits with another stride are copied once).

Launch choice for whole-vocab rows (V = 151,936 for Qwen3): BLOCK_V = 4096 with 8 warps gives
16 elements per thread per tile, i.e. two 16-byte bf16 vector loads in flight per thread, and
38 tiles per row (2.4% of lanes masked, all in the last tile). Compiled for sm_90 it uses 80
registers and no spills (3 programs, 24 warps per SM) and ~18 SASS instructions per element in
each sweep, one MUFU.EX2 among them. Smaller V uses the next power of two, keeping 16 elements
per thread. Not yet timed on an H100/H200: bench/kernels/ owns that measurement.

Traffic per live row (bf16): 2V bytes read in each sweep plus 2V bytes of gradient written
(6V in all; the second read may hit L2, the row was just read) and ~50 bytes of per-token
scalars. A skipped row writes 2V bytes of zero gradient (nothing when no gradient is asked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from osvl_kernels.loss_config import LossHyper
from osvl_kernels.token_results import RowStats, TokenPassResult

MAX_BLOCK_V = 4096
ELEMENTS_PER_THREAD = 16
MAX_NUM_WARPS = 8
SCALE_BLOCK = 4096
SCALE_PROGRAMS_PER_SM = 4


def launch_config(vocab_size: int, block_v: int | None = None) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for rows of `vocab_size` columns; `block_v` overrides the tile width."""
    if block_v is None:
        block_v = min(MAX_BLOCK_V, triton.next_power_of_2(max(vocab_size, 16)))
    elif not isinstance(block_v, int) or block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v!r}")
    num_warps = min(MAX_NUM_WARPS, max(1, block_v // (32 * ELEMENTS_PER_THREAD)))
    return block_v, num_warps


# ----------------------------------------------------------------------------------------------
# jit building blocks (inlined into the kernels)


@triton.jit
def _online_row_stats(row_ptr, n_cols, inv_temp, BLOCK_V: tl.constexpr):
    """(max, sum exp(z'-max), sum exp(z'-max) * z') of one row; (-inf, 0, 0) if it has no finite entry.

    One running max per row (a tile max per step); the sums stay per lane until the end.
    """
    cols = tl.arange(0, BLOCK_V)
    row_max = tl.full([], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK_V], tl.float32)
    lane_zsum = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        idx = start + cols
        z = tl.load(row_ptr + idx, mask=idx < n_cols, other=float("-inf")).to(tl.float32) * inv_temp
        new_max = tl.maximum(row_max, tl.max(z, axis=0))
        # While nothing finite was seen, shift by 0: exp(-inf - 0) = 0 instead of exp(-inf + inf) = nan.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        e = tl.exp(z - shift)
        rescale = tl.exp(row_max - shift)
        lane_sum = lane_sum * rescale + e
        lane_zsum = lane_zsum * rescale + e * tl.where(z == float("-inf"), 0.0, z)  # 0 * -inf would be nan
        row_max = new_max
    return row_max, tl.sum(lane_sum, axis=0), tl.sum(lane_zsum, axis=0)


@triton.jit
def _write_grad_row(
    row_ptr,
    grad_row_ptr,
    n_cols,
    local_target,
    lse,
    entropy,
    coef_logp,
    coef_entropy,
    inv_temp,
    BLOCK_V: tl.constexpr,
):
    """grad_j = (coef_logp * (onehot_j - p_j) + coef_entropy * p_j * (log p_j + H)) / temperature."""
    cols = tl.arange(0, BLOCK_V)
    coef_logp = coef_logp * inv_temp
    coef_entropy = coef_entropy * inv_temp
    for start in range(0, n_cols, BLOCK_V):
        idx = start + cols
        mask = idx < n_cols
        z = tl.load(row_ptr + idx, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        logp = z - lse
        p = tl.exp(logp)
        logp_finite = tl.where(p > 0.0, logp, 0.0)
        grad = p * (coef_entropy * (logp_finite + entropy) - coef_logp)
        grad = tl.where(idx == local_target, grad + coef_logp, grad)
        tl.store(grad_row_ptr + idx, grad.to(grad_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _zero_row(grad_row_ptr, n_cols, BLOCK_V: tl.constexpr):
    cols = tl.arange(0, BLOCK_V)
    zeros = tl.zeros([BLOCK_V], grad_row_ptr.dtype.element_ty)
    for start in range(0, n_cols, BLOCK_V):
        idx = start + cols
        tl.store(grad_row_ptr + idx, zeros, mask=idx < n_cols)


# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _token_pass_kernel(
    logits_ptr,
    logits_row_stride,
    target_ptr,
    weight_ptr,
    adv_ptr,
    old_ptr,
    ref_ptr,
    grad_ptr,
    grad_row_stride,
    values_ptr,
    flags_ptr,  # [5, T] fp32 (logp, entropy, loss, ratio, kl), [2, T] u8 (clipped, dual)
    num_rows,
    n_cols,
    inv_temp,
    clip_low,
    clip_high,
    dual_clip,
    kl_coef,
    entropy_coef,
    kl_max,
    ON_POLICY: tl.constexpr,
    HAS_DUAL_CLIP: tl.constexpr,
    HAS_KL: tl.constexpr,
    HAS_KL_MAX: tl.constexpr,
    KL_IS_WEIGHTED: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    grad_row_ptr = grad_ptr + row * grad_row_stride
    weight = tl.load(weight_ptr + row)
    if weight > 0:
        target = tl.load(target_ptr + row)
        target = tl.minimum(tl.maximum(target, 0), n_cols - 1).to(tl.int32)  # in range: memory safe
        z_target = tl.load(row_ptr + target).to(tl.float32) * inv_temp
        row_max, sumexp, zexp = _online_row_stats(row_ptr, n_cols, inv_temp, BLOCK_V)
        lse = row_max + tl.log(sumexp)
        logp = tl.minimum(z_target - lse, 0.0)
        entropy = lse - zexp / sumexp
        adv = tl.load(adv_ptr + row).to(tl.float32)
        if ON_POLICY:
            old = logp
        else:
            old = tl.load(old_ptr + row).to(tl.float32)
        ratio = tl.exp(logp - old)
        unclipped = -ratio * adv
        clipped = -tl.minimum(tl.maximum(ratio, clip_low), clip_high) * adv
        take_unclipped = unclipped >= clipped
        loss = tl.where(take_unclipped, unclipped, clipped)
        dloss = tl.where(take_unclipped, unclipped, 0.0)
        if HAS_DUAL_CLIP:
            cap = -dual_clip * adv
            dual = (adv < 0.0) & (loss > cap)
            loss = tl.where(dual, cap, loss)
            dloss = tl.where(dual, 0.0, dloss)
            tl.store(flags_ptr + num_rows + row, tl.where(dual, 1, 0).to(tl.uint8))
        else:
            tl.store(flags_ptr + num_rows + row, tl.zeros([], tl.uint8))
        if HAS_KL:
            delta = tl.load(ref_ptr + row).to(tl.float32) - logp
            ratio_ref = tl.exp(delta)
            kl = ratio_ref - delta - 1.0
            dkl = 1.0 - ratio_ref
            if HAS_KL_MAX:
                over = kl > kl_max
                kl = tl.where(over, kl_max, kl)
                dkl = tl.where(over, 0.0, dkl)
            if KL_IS_WEIGHTED:
                dkl = ratio * (kl + dkl)
                kl = ratio * kl
            loss = loss + kl_coef * kl
            dloss = dloss + kl_coef * dkl
            tl.store(values_ptr + 4 * num_rows + row, kl)
        else:
            tl.store(values_ptr + 4 * num_rows + row, 0.0)
        tl.store(values_ptr + row, logp)
        tl.store(values_ptr + num_rows + row, entropy)
        tl.store(values_ptr + 2 * num_rows + row, loss - entropy_coef * entropy)
        tl.store(values_ptr + 3 * num_rows + row, ratio)
        tl.store(flags_ptr + row, tl.where(take_unclipped, 0, 1).to(tl.uint8))
        if WRITE_GRAD:
            coef_logp = weight * dloss
            coef_entropy = weight * entropy_coef
            if (coef_logp != 0.0) | (coef_entropy != 0.0):
                _write_grad_row(
                    row_ptr,
                    grad_row_ptr,
                    n_cols,
                    target,
                    lse,
                    entropy,
                    coef_logp,
                    coef_entropy,
                    inv_temp,
                    BLOCK_V,
                )
            else:
                _zero_row(grad_row_ptr, n_cols, BLOCK_V)
    else:
        for k in tl.static_range(5):
            tl.store(values_ptr + k * num_rows + row, 0.0)
        tl.store(flags_ptr + row, tl.zeros([], tl.uint8))
        tl.store(flags_ptr + num_rows + row, tl.zeros([], tl.uint8))
        if WRITE_GRAD:
            _zero_row(grad_row_ptr, n_cols, BLOCK_V)


@triton.jit
def _row_stats_kernel(
    logits_ptr,
    logits_row_stride,
    target_ptr,
    valid_ptr,
    stats_ptr,  # [4, T] fp32: max, sumexp, zexp, target
    num_rows,
    n_cols,
    vocab_start,
    inv_temp,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    if tl.load(valid_ptr + row) != 0:
        row_max, sumexp, zexp = _online_row_stats(row_ptr, n_cols, inv_temp, BLOCK_V)
        local_target = tl.load(target_ptr + row).to(tl.int64) - vocab_start
        in_shard = (local_target >= 0) & (local_target < n_cols)
        z_target = tl.load(row_ptr + tl.where(in_shard, local_target, 0), mask=in_shard, other=0.0)
        tl.store(stats_ptr + row, row_max)
        tl.store(stats_ptr + num_rows + row, sumexp)
        tl.store(stats_ptr + 2 * num_rows + row, zexp)
        tl.store(stats_ptr + 3 * num_rows + row, z_target.to(tl.float32) * inv_temp)
    else:
        tl.store(stats_ptr + row, 0.0)
        tl.store(stats_ptr + num_rows + row, 1.0)
        tl.store(stats_ptr + 2 * num_rows + row, 0.0)
        tl.store(stats_ptr + 3 * num_rows + row, 0.0)


@triton.jit
def _grad_from_stats_kernel(
    logits_ptr,
    logits_row_stride,
    target_ptr,
    lse_ptr,
    entropy_ptr,
    coef_logp_ptr,
    coef_entropy_ptr,
    grad_ptr,
    grad_row_stride,
    n_cols,
    vocab_start,
    inv_temp,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    grad_row_ptr = grad_ptr + row * grad_row_stride
    coef_logp = tl.load(coef_logp_ptr + row).to(tl.float32)
    coef_entropy = tl.load(coef_entropy_ptr + row).to(tl.float32)
    if (coef_logp != 0.0) | (coef_entropy != 0.0):
        local_target = tl.load(target_ptr + row).to(tl.int64) - vocab_start
        local_target = tl.minimum(tl.maximum(local_target, -1), n_cols).to(tl.int32)  # -1, n_cols: not here
        _write_grad_row(
            logits_ptr + row * logits_row_stride,
            grad_row_ptr,
            n_cols,
            local_target,
            tl.load(lse_ptr + row).to(tl.float32),
            tl.load(entropy_ptr + row).to(tl.float32),
            coef_logp,
            coef_entropy,
            inv_temp,
            BLOCK_V,
        )
    else:
        _zero_row(grad_row_ptr, n_cols, BLOCK_V)


@triton.jit
def _scale_kernel(x_ptr, scale_ptr, numel, BLOCK: tl.constexpr):
    """x *= scale, read on device; a scale of exactly 1 (plain `loss.backward()`) costs no traffic."""
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        cols = tl.arange(0, BLOCK)
        first = tl.program_id(0).to(tl.int64) * BLOCK
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(first, numel, step):
            idx = start + cols
            mask = idx < numel
            x = tl.load(x_ptr + idx, mask=mask).to(tl.float32)
            tl.store(x_ptr + idx, (x * scale).to(x_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# host wrappers: shape checks (no device sync) and launches


def _check_rows(name: str, x: torch.Tensor, num_rows: int, device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.shape[0] != num_rows:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must have shape [{num_rows}], got {shape}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device}")
    return x.contiguous()


def _check_logits(logits: torch.Tensor) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("logits must be a 2-D [T, V] tensor")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be fp32/bf16/fp16 for the Triton backend, got {logits.dtype}")
    return logits if logits.stride(1) == 1 else logits.contiguous()


def _check_grad_out(grad_out: torch.Tensor, logits: torch.Tensor) -> None:
    if grad_out.shape != logits.shape or grad_out.device != logits.device:
        raise ValueError(
            f"grad_out must match logits {tuple(logits.shape)} on {logits.device}, "
            f"got {tuple(grad_out.shape)} on {grad_out.device}"
        )
    if grad_out.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"grad_out must be fp32/bf16/fp16, got {grad_out.dtype}")
    if grad_out.shape[1] > 1 and grad_out.stride(1) != 1:
        raise ValueError("grad_out must have unit stride along the vocab dimension")


def token_pass_triton(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    weight: torch.Tensor,
    advantage: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    hyper: LossHyper,
    grad_out: torch.Tensor | None,
    *,
    block_v: int | None = None,
) -> TokenPassResult:
    """Fused forward + gradient over whole-vocab rows in one launch (see token_pass.token_pass)."""
    logits = _check_logits(logits)
    if grad_out is not None:
        _check_grad_out(grad_out, logits)
    T, V = logits.shape
    device = logits.device
    target_ids = _check_rows("target_ids", target_ids, T, device)
    weight = _check_rows("weight", weight, T, device)
    advantage = _check_rows("advantage", advantage, T, device)
    old = None if old_logprobs is None else _check_rows("old_logprobs", old_logprobs, T, device)
    ref = None if ref_logprobs is None else _check_rows("ref_logprobs", ref_logprobs, T, device)
    block, num_warps = launch_config(V, block_v)
    values = torch.empty(5, T, dtype=torch.float32, device=device)
    flags = torch.empty(2, T, dtype=torch.bool, device=device)
    has_kl = ref is not None and hyper.kl_coef != 0.0
    if T > 0:
        grad = logits if grad_out is None else grad_out  # an unused pointer when no gradient is asked
        _token_pass_kernel[(T,)](
            logits,
            logits.stride(0),
            target_ids,
            weight,
            advantage,
            weight if old is None else old,
            weight if ref is None else ref,
            grad,
            grad.stride(0),
            values,
            flags.view(torch.uint8),
            T,
            V,
            1.0 / hyper.temperature,
            1.0 - hyper.eps_low,
            1.0 + hyper.eps_high,
            0.0 if hyper.dual_clip is None else hyper.dual_clip,
            hyper.kl_coef,
            hyper.entropy_coef,
            0.0 if hyper.kl_max is None else hyper.kl_max,
            ON_POLICY=old is None,
            HAS_DUAL_CLIP=hyper.dual_clip is not None,
            HAS_KL=has_kl,
            HAS_KL_MAX=hyper.kl_max is not None,
            KL_IS_WEIGHTED=hyper.kl_is_weighted,
            WRITE_GRAD=grad_out is not None,
            BLOCK_V=block,
            num_warps=num_warps,
        )
    logp, entropy, loss, ratio, kl = values.unbind(0)
    clipped, dual_clipped = flags.unbind(0)
    return TokenPassResult(
        logp=logp, entropy=entropy, loss=loss, ratio=ratio, clipped=clipped, dual_clipped=dual_clipped, kl=kl
    )


def row_stats_triton(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    valid: torch.Tensor,
    vocab_start: int,
    temperature: float,
    *,
    block_v: int | None = None,
) -> RowStats:
    """Per-row statistics over this rank's vocab shard (see token_pass.row_stats)."""
    logits = _check_logits(logits)
    T, V = logits.shape
    device = logits.device
    target_ids = _check_rows("target_ids", target_ids, T, device)
    valid = _check_rows("valid", valid, T, device)
    if valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor, got {valid.dtype}")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    block, num_warps = launch_config(V, block_v)
    stats = torch.empty(4, T, dtype=torch.float32, device=device)
    if T > 0:
        _row_stats_kernel[(T,)](
            logits,
            logits.stride(0),
            target_ids,
            valid.view(torch.uint8),
            stats,
            T,
            V,
            int(vocab_start),
            1.0 / temperature,
            BLOCK_V=block,
            num_warps=num_warps,
        )
    return RowStats(*stats.unbind(0))


def grad_from_stats_triton(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    vocab_start: int,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    coef_logp: torch.Tensor,
    coef_entropy: torch.Tensor,
    temperature: float,
    grad_out: torch.Tensor,
    *,
    block_v: int | None = None,
) -> None:
    """This shard's gradient columns from the global statistics (see token_pass.grad_from_stats)."""
    logits = _check_logits(logits)
    _check_grad_out(grad_out, logits)
    T, V = logits.shape
    device = logits.device
    rows = {
        name: _check_rows(name, x, T, device)
        for name, x in (
            ("target_ids", target_ids),
            ("lse", lse),
            ("entropy", entropy),
            ("coef_logp", coef_logp),
            ("coef_entropy", coef_entropy),
        )
    }
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    block, num_warps = launch_config(V, block_v)
    if T > 0:
        _grad_from_stats_kernel[(T,)](
            logits,
            logits.stride(0),
            rows["target_ids"],
            rows["lse"],
            rows["entropy"],
            rows["coef_logp"],
            rows["coef_entropy"],
            grad_out,
            grad_out.stride(0),
            V,
            int(vocab_start),
            1.0 / temperature,
            BLOCK_V=block,
            num_warps=num_warps,
        )


def _persistent_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return SCALE_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def scale_triton_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x *= scale in place, with `scale` a 0-d device tensor read by the kernel (no host sync).

    A persistent grid of a few programs per SM: when scale == 1 every program exits after one
    scalar load, so the usual `loss.backward()` adds no pass over the [T, V] gradient.
    """
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.device != x.device:
        raise ValueError(f"scale must be a one-element tensor on {x.device}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be fp32/bf16/fp16, got {x.dtype}")
    numel = x.numel()
    if numel > 0:
        programs = min(triton.cdiv(numel, SCALE_BLOCK), _persistent_programs(x.device))
        _scale_kernel[(programs,)](x, scale.reshape(()), numel, BLOCK=SCALE_BLOCK, num_warps=4)
    return x
