"""Triton token-pass kernels (under TRITON_INTERPRET=1 on CPU) vs float64 autograd and the torch backend.

Tiny rows with small tiles (block_v=16) so the online loop runs several tiles, the last one partial.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from osvl_kernels.autograd import scale_grad_
from osvl_kernels.loss_config import LossHyper
from osvl_kernels.objective import token_terms
from osvl_kernels.token_pass import grad_from_stats, row_stats, token_pass
from osvl_kernels.triton_token_pass import (
    grad_from_stats_triton,
    launch_config,
    row_stats_triton,
    scale_triton_,
    token_pass_triton,
)
from osvl_kernels.vocab_parallel import vocab_parallel_token_pass

NINF = float("-inf")
EVERYTHING = LossHyper(eps_low=0.1, eps_high=0.3, dual_clip=2.0, kl_coef=0.1, entropy_coef=0.05, temperature=0.7)


def make_rows(seed: int, T: int = 10, V: int = 37, dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    weight = torch.rand(T, generator=g) + 0.1
    weight[torch.rand(T, generator=g) < 0.3] = 0.0
    logits = (torch.randn(T, V, generator=g) * 2.0).to(dtype)
    target_ids = torch.randint(0, V, (T,), generator=g)
    # Old/ref log-probs near the current ones (at EVERYTHING's temperature) so ratios straddle the clips.
    logp_all = torch.log_softmax(logits.float() / EVERYTHING.temperature, -1)
    logp = logp_all.gather(1, target_ids[:, None]).squeeze(1)
    return dict(
        logits=logits,
        target_ids=target_ids,
        weight=weight,
        advantage=torch.randn(T, generator=g),
        old_logprobs=logp + 0.8 * torch.randn(T, generator=g),
        ref_logprobs=logp + 0.8 * torch.randn(T, generator=g),
    )


def float64_token_pass(rows: dict, hyper: LossHyper, on_policy: bool):
    """(logp, entropy, per-token loss, d(sum weight*loss)/d(logits)) by float64 autograd."""
    z = rows["logits"].double().requires_grad_()
    logp_all = torch.log_softmax(z / hyper.temperature, dim=-1)
    probs = logp_all.exp()
    entropy = -(probs * torch.where(probs > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
    logp = logp_all.gather(1, rows["target_ids"][:, None]).squeeze(1).clamp_max(0.0)
    old = logp.detach() if on_policy else rows["old_logprobs"].double()
    terms = token_terms(logp, rows["advantage"].double(), old, rows["ref_logprobs"].double(), hyper)
    loss = terms.loss - hyper.entropy_coef * entropy
    valid = rows["weight"] > 0
    (rows["weight"].double() * torch.where(valid, loss, torch.zeros_like(loss))).sum().backward()

    def on_valid(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x.detach(), torch.zeros_like(logp))

    return on_valid(logp), on_valid(entropy), on_valid(loss), z.grad


def run_triton(rows: dict, hyper: LossHyper, on_policy: bool, block_v: int | None = 16, inplace: bool = False):
    """With `inplace` the gradient overwrites rows["logits"]."""
    logits = rows["logits"]
    grad = logits if inplace else torch.full_like(logits, float("nan"))
    old = None if on_policy else rows["old_logprobs"]
    out = token_pass_triton(
        logits,
        rows["target_ids"],
        rows["weight"],
        rows["advantage"],
        old,
        rows["ref_logprobs"],
        hyper,
        grad,
        block_v=block_v,
    )
    return out, grad


def run_torch(rows: dict, hyper: LossHyper, on_policy: bool):
    grad = torch.empty_like(rows["logits"])
    old = None if on_policy else rows["old_logprobs"]
    out = token_pass(
        rows["logits"],
        rows["target_ids"],
        rows["weight"],
        rows["advantage"],
        old,
        rows["ref_logprobs"],
        hyper,
        grad,
        backend="torch",
    )
    return out, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "hyper, on_policy",
    [(LossHyper(), True), (EVERYTHING, False)],
    ids=["on-policy-plain", "off-policy-dual-kl-entropy-temperature"],
)
def test_token_pass_matches_float64_and_torch_backend(dtype, hyper, on_policy):
    rows = make_rows(seed=1, dtype=dtype)  # V=37 over 16-wide tiles: 3 tiles, the last one partial
    # Row 0: ratio e^1.5 > dual_clip with A < 0, so the dual cap is active.
    rows["weight"][0], rows["advantage"][0] = 0.5, -1.0
    logp0 = torch.log_softmax(rows["logits"][0].float() / EVERYTHING.temperature, -1)[rows["target_ids"][0]]
    rows["old_logprobs"][0] = logp0 - 1.5
    got, grad = run_triton(rows, hyper, on_policy)
    ref_logp, ref_entropy, ref_loss, ref_grad = float64_token_pass(rows, hyper, on_policy)
    torch.testing.assert_close(got.logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
    assert grad.dtype == dtype and got.logp.dtype == torch.float32
    grad_tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(grad.double(), ref_grad, **grad_tol)

    expected, expected_grad = run_torch(rows, hyper, on_policy)
    for name in ("logp", "entropy", "loss", "ratio", "kl"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.clipped, expected.clipped) and torch.equal(got.dual_clipped, expected.dual_clipped)
    torch.testing.assert_close(grad.float(), expected_grad.float(), **grad_tol)
    if not on_policy:
        assert got.clipped.any() and got.dual_clipped.any()  # both branches were exercised
    else:
        assert (got.ratio[rows["weight"] > 0] == 1.0).all()


def test_skipped_rows_read_nothing_and_get_zero_gradient():
    rows = make_rows(seed=2)
    skipped = rows["weight"] == 0
    assert skipped.any() and (~skipped).any()
    clean, clean_grad = run_triton(rows, EVERYTHING, on_policy=False)
    rows["logits"][skipped] = float("nan")  # a skipped row must not even be read
    rows["target_ids"][skipped] = -7
    rows["advantage"][skipped] = float("nan")
    got, grad = run_triton(rows, EVERYTHING, on_policy=False)
    for name in ("logp", "entropy", "loss", "ratio", "kl"):
        assert (getattr(got, name)[skipped] == 0).all()
        torch.testing.assert_close(getattr(got, name), getattr(clean, name), rtol=0, atol=0)
    assert not got.clipped[skipped].any() and not got.dual_clipped[skipped].any()
    assert (grad[skipped] == 0).all()
    torch.testing.assert_close(grad, clean_grad, rtol=0, atol=0)


def test_rows_with_zero_coefficients_get_zero_gradient():
    rows = make_rows(seed=3)
    rows["advantage"][:4] = 0.0  # on-policy, no entropy/KL: d(loss)/d(logits) is exactly 0
    _, grad = run_triton(rows, LossHyper(), on_policy=True)
    assert (grad[:4] == 0).all()
    assert (grad[4:][rows["weight"][4:] > 0] != 0).any()


@pytest.mark.parametrize("block_v", [16, None], ids=["tiles", "one-tile"])
def test_masked_vocab_entries_match_a_trimmed_vocab(block_v):
    rows = make_rows(seed=4, V=64)  # 64 = 4 full tiles of 16: masked tail is all -inf
    trimmed = dict(rows, logits=rows["logits"][:, :40].contiguous(), target_ids=rows["target_ids"] % 40)
    padded = dict(trimmed, logits=rows["logits"].clone())
    padded["logits"][:, 40:] = NINF
    padded["logits"][0, :32] = NINF  # a row whose first two tiles hold nothing finite
    trimmed["logits"][0, :32] = NINF
    padded["target_ids"][0] = trimmed["target_ids"][0] = 35
    padded["logits"][1, ::3] = NINF  # scattered -inf entries, lanes that start at -inf
    trimmed["logits"][1, ::3] = NINF
    padded["target_ids"][1] = trimmed["target_ids"][1] = 1
    got, grad = run_triton(padded, EVERYTHING, on_policy=False, block_v=block_v)
    expected, expected_grad = run_triton(trimmed, EVERYTHING, on_policy=False, block_v=block_v)
    assert torch.isfinite(grad).all() and torch.isfinite(got.loss).all() and torch.isfinite(got.entropy).all()
    for name in ("logp", "entropy", "loss", "ratio", "kl"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad[:, :40], expected_grad, rtol=1e-6, atol=1e-7)
    assert (grad[:, 40:] == 0).all()
    ref_logp, ref_entropy, _, ref_grad = float64_token_pass(trimmed, EVERYTHING, on_policy=False)
    torch.testing.assert_close(got.logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad[:, :40].double(), ref_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_inplace_gradient_aliasing_logits(dtype):
    rows = make_rows(seed=5, dtype=dtype)
    expected, expected_grad = run_triton(rows, EVERYTHING, on_policy=False)
    logits = rows["logits"].clone()
    got, grad = run_triton(dict(rows, logits=logits), EVERYTHING, on_policy=False, inplace=True)
    assert grad is logits
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
    torch.testing.assert_close(got.loss, expected.loss, rtol=0, atol=0)


def test_row_offsets_are_int64():
    """Row 2 starts 2^31 elements past row 0: an int32 row offset would wrap to another address.

    The [T, V] view lives in an 8 GiB virtual bf16 allocation of which only a few pages are touched.
    """
    V, stride, start = 24, 2**30, 2**31
    storage = torch.empty(start + 2 * stride + V, dtype=torch.bfloat16)
    storage[: 2 * V].zero_()  # where a wrapped offset would land
    logits = storage.as_strided((3, V), (stride, 1), start)
    rows = make_rows(seed=6, T=3, V=V, dtype=torch.bfloat16)
    rows["weight"] = torch.tensor([0.3, 0.0, 0.5])
    logits.copy_(rows["logits"])
    expected, expected_grad = run_triton(rows, EVERYTHING, on_policy=False)
    got, grad = run_triton(dict(rows, logits=logits), EVERYTHING, on_policy=False, inplace=True)
    assert grad.data_ptr() == logits.data_ptr()
    torch.testing.assert_close(got.logp, expected.logp, rtol=0, atol=0)
    torch.testing.assert_close(logits, expected_grad, rtol=0, atol=0)

    logits.copy_(rows["logits"])
    valid = torch.tensor([True, False, True])
    stats = row_stats_triton(logits, rows["target_ids"], valid, 0, 0.7)
    contiguous = row_stats_triton(rows["logits"], rows["target_ids"], valid, 0, 0.7)
    for name in ("max", "sumexp", "zexp", "target"):
        torch.testing.assert_close(getattr(stats, name), getattr(contiguous, name), rtol=0, atol=0)
    assert (storage[: 2 * V] == 0).all()


def combine_shards(shards: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse, target logit, entropy) in float64 from per-shard statistics (what the all-reduce does)."""
    m = torch.stack([s.max.double() for s in shards]).max(0).values
    scale = [torch.where(s.max == NINF, 0.0, torch.exp(s.max.double() - m)) for s in shards]
    sumexp = sum(k * s.sumexp.double() for k, s in zip(scale, shards))
    zexp = sum(k * s.zexp.double() for k, s in zip(scale, shards))
    lse = m + torch.log(sumexp)
    return lse, sum(s.target.double() for s in shards), lse - zexp / sumexp


def test_row_stats_over_vocab_shards():
    rows = make_rows(seed=7, T=8, V=37)
    rows["weight"][:4] = 0.5
    rows["target_ids"][:4] = torch.tensor([0, 19, 20, 36])  # shard edges on both sides
    valid = rows["weight"] > 0
    z = rows["logits"].double() / 0.7
    bounds = [(0, 20), (20, 37)]
    shards = []
    for lo, hi in bounds:
        local = rows["logits"][:, lo:hi]
        got = row_stats_triton(local, rows["target_ids"], valid, lo, 0.7, block_v=16)
        expected = row_stats(local, rows["target_ids"], valid, lo, 0.7, backend="torch")
        for name in ("max", "sumexp", "zexp", "target"):
            torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=1e-6, atol=1e-6)
        owns = (rows["target_ids"] >= lo) & (rows["target_ids"] < hi) & valid
        assert (got.target[valid & ~owns] == 0).all()
        assert (got.target[owns] != 0).all()
        inactive = torch.stack([got.max, got.sumexp, got.zexp, got.target])[:, ~valid]
        assert (inactive == torch.tensor([[0.0], [1.0], [0.0], [0.0]])).all()
        shards.append(got)
    lse, target, entropy = combine_shards(shards)
    ref_lse = torch.logsumexp(z, -1)
    ref_entropy = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    torch.testing.assert_close(lse[valid], ref_lse[valid], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy[valid], ref_entropy[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(target[valid], z.gather(1, rows["target_ids"][:, None]).squeeze(1)[valid])


def test_row_stats_of_an_all_masked_or_empty_shard():
    valid = torch.tensor([True, True])
    target = torch.tensor([3, 50])
    masked = row_stats_triton(torch.full((2, 20), NINF), target, valid, 0, 1.0, block_v=16)
    empty = row_stats_triton(torch.empty(2, 0), target, valid, 0, 1.0)
    for stats in (masked, empty):
        assert (stats.max == NINF).all() and (stats.sumexp == 0).all() and (stats.zexp == 0).all()
    assert masked.target[0] == NINF and masked.target[1] == 0 and (empty.target == 0).all()


@pytest.mark.parametrize("inplace", [False, True], ids=["separate", "inplace"])
def test_grad_from_stats_over_vocab_shards_rebuilds_the_full_gradient(inplace):
    rows = make_rows(seed=8, T=8, V=37)
    valid = rows["weight"] > 0
    full, full_grad = run_triton(rows, EVERYTHING, on_policy=False)
    bounds = ((0, 20), (20, 37))
    shards = [row_stats_triton(rows["logits"][:, lo:hi], rows["target_ids"], valid, lo, 0.7) for lo, hi in bounds]
    lse, _, entropy = combine_shards(shards)
    terms = token_terms(full.logp, rows["advantage"], rows["old_logprobs"], rows["ref_logprobs"], EVERYTHING)
    coef_logp = rows["weight"] * terms.dloss_dlogp
    coef_entropy = rows["weight"] * EVERYTHING.entropy_coef
    logits = rows["logits"].clone()
    logits[~valid] = float("nan")  # rows with both coefficients 0 are written as zeros, never read
    pieces = []
    for lo, hi in bounds:
        local = logits[:, lo:hi].contiguous()
        grad = local if inplace else torch.full_like(local, float("nan"))
        args = (rows["target_ids"], lo, lse.float(), entropy.float(), coef_logp, coef_entropy, 0.7)
        grad_from_stats_triton(local, *args, grad, block_v=16)
        expected = torch.empty_like(local)
        grad_from_stats(logits[:, lo:hi], *args, expected, backend="torch")
        torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-7)
        pieces.append(grad)
    torch.testing.assert_close(torch.cat(pieces, 1), full_grad, rtol=1e-5, atol=1e-6)
    assert (full_grad[~valid] == 0).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_vocab_parallel_token_pass_without_a_group_is_the_whole_vocab_pass(backend):
    rows = make_rows(seed=9, T=8, V=37)
    logp, entropy, loss, full_grad = float64_token_pass(rows, EVERYTHING, on_policy=False)
    grad = torch.full_like(rows["logits"], float("nan"))
    out = vocab_parallel_token_pass(
        rows["logits"],
        rows["target_ids"],
        0,
        rows["weight"],
        rows["advantage"],
        rows["old_logprobs"],
        rows["ref_logprobs"],
        EVERYTHING,
        grad,
        None,
        backend=backend,
    )
    torch.testing.assert_close(out.logp.double(), logp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.entropy.double(), entropy, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss.double(), loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), full_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scale", [1.0, 2.5, -0.5, 0.0])
def test_scale_in_place_reads_the_scalar_on_device(dtype, scale):
    x = torch.randn(5 * 4096 + 7, generator=torch.Generator().manual_seed(9)).to(dtype)  # > programs * block
    expected = (x.float() * scale).to(dtype)
    out = scale_triton_(x, torch.tensor(scale))
    assert out is x
    # fp32 math, one rounding; the interpreter's fp32 -> bf16 cast may differ from round-to-nearest by 1 ulp.
    torch.testing.assert_close(x, expected, rtol=0 if dtype == torch.float32 else 2**-7, atol=0)


def test_scale_grad_uses_the_kernel_or_falls_back_to_mul():
    base = torch.randn(6, 10)
    for grad in (base.clone(), base.t().clone().t(), base.double()):  # kernel, non-contiguous, fp64
        expected = grad * -1.5
        out = scale_grad_(grad, torch.tensor(-1.5))
        assert out is grad
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_launch_config_for_qwen_vocab_and_small_rows():
    assert launch_config(151_936) == (4096, 8)  # 16 elements per thread
    assert launch_config(37) == (64, 1)
    assert launch_config(151_936, block_v=1024) == (1024, 2)
    for bad in (24, 8, 0, 16.0):
        with pytest.raises(ValueError, match="block_v"):
            launch_config(100, block_v=bad)


def test_empty_batch():
    out = token_pass_triton(
        torch.empty(0, 11),
        torch.empty(0, dtype=torch.long),
        torch.empty(0),
        torch.empty(0),
        None,
        None,
        LossHyper(),
        torch.empty(0, 11),
    )
    assert out.logp.shape == (0,) and out.clipped.dtype == torch.bool


def test_bad_inputs_raise_before_anything_is_written():
    rows = make_rows(seed=10, T=4, V=20)
    grad = torch.full_like(rows["logits"], 7.0)
    args = [rows[k] for k in ("logits", "target_ids", "weight", "advantage", "old_logprobs", "ref_logprobs")]
    cases = [
        (dict(grad_out=torch.empty(4, 19)), "grad_out must match"),
        (dict(grad_out=torch.empty(20, 4).t()), "unit stride"),
        (dict(weight=torch.ones(3)), r"weight must have shape \[4\]"),
        (dict(logits=rows["logits"].double()), "fp32/bf16/fp16"),
        (dict(logits=rows["logits"][0]), "2-D"),
        (dict(block_v=48), "power of two"),
    ]
    names = ["logits", "target_ids", "weight", "advantage", "old_logprobs", "ref_logprobs"]
    for override, message in cases:
        kwargs = dict(zip(names, args), hyper=EVERYTHING, grad_out=grad)
        kwargs.update(override)
        with pytest.raises(ValueError, match=message):
            token_pass_triton(**kwargs)
        assert (grad == 7.0).all()
    with pytest.raises(ValueError, match="valid must be a bool"):
        row_stats_triton(rows["logits"], rows["target_ids"], rows["weight"], 0, 1.0)
    with pytest.raises(ValueError, match="temperature"):
        row_stats_triton(rows["logits"], rows["target_ids"], rows["weight"] > 0, 0, 0.0)
    ones = torch.ones(4)
    with pytest.raises(ValueError, match=r"lse must have shape"):
        grad_from_stats_triton(rows["logits"], rows["target_ids"], 0, ones[:2], ones, ones, ones, 1.0, grad)
    assert (grad == 7.0).all()
    with pytest.raises(ValueError, match="one-element"):
        scale_triton_(grad, torch.ones(2))
    with pytest.raises(ValueError, match="contiguous"):
        scale_triton_(grad.t(), torch.ones(()))
    assert (grad == 7.0).all()


COMPILE_FOR_HOPPER = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from osvl_kernels import triton_token_pass as m

TYPES = {"logits_ptr": "*bf16", "grad_ptr": "*bf16", "x_ptr": "*bf16", "target_ptr": "*i64",
         "valid_ptr": "*u8", "flags_ptr": "*u8"}
INTS = ("_stride", "num_rows", "n_cols", "vocab_start", "numel")

def ptx(fn, constexprs, num_warps):
    def kind(name):
        if name in constexprs:
            return "constexpr"
        if name in TYPES or name.endswith("_ptr"):
            return TYPES.get(name, "*fp32")
        return "i32" if name.endswith(INTS) else "fp32"
    sig = {name: kind(name) for name in fn.arg_names}
    # What the launcher specialises at run time for 16-aligned pointers, strides and sizes.
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig[name].startswith("*") or (sig[name] == "i32" and name != "vocab_start")}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]

block, warps = m.launch_config(151936)
flags = dict(ON_POLICY=False, HAS_DUAL_CLIP=True, HAS_KL=True, WRITE_GRAD=True, BLOCK_V=block)
print(json.dumps({
    "token_pass": ptx(m._token_pass_kernel, flags, warps),
    "row_stats": ptx(m._row_stats_kernel, dict(BLOCK_V=block), warps),
    "grad_from_stats": ptx(m._grad_from_stats_kernel, dict(BLOCK_V=block), warps),
    "scale": ptx(m._scale_kernel, dict(BLOCK=m.SCALE_BLOCK), 4),
}))
"""


def test_kernels_compile_for_hopper_with_vector_loads():
    """The interpreter accepts code the compiler rejects: compile each kernel to sm_90 PTX (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(ptx) == {"token_pass", "row_stats", "grad_from_stats", "scale"}
    # bf16 rows move in 16-byte vectors (8 elements) in both sweeps and in the gradient store.
    assert ptx["token_pass"].count("ld.global.v4.b32") >= 2 and "st.global.v4.b32" in ptx["token_pass"]
    assert "ld.global.v4.b32" in ptx["row_stats"] and "st.global.v4.b32" in ptx["grad_from_stats"]
    assert "ld.global.v4.b32" in ptx["scale"] and "st.global.v4.b32" in ptx["scale"]


def test_torch_row_stats_agree_with_triton_on_empty_and_all_inf_shards():
    from osvl_kernels.token_pass import row_stats

    logits = torch.randn(3, 6)
    logits[1] = float("-inf")
    targets = torch.tensor([0, 1, 2])
    valid = torch.tensor([True, True, False])
    for shard in (logits, logits[:, :0]):
        got = row_stats(shard, targets, valid, 0, 1.0, backend="torch")
        want = row_stats(shard, targets, valid, 0, 1.0, backend="triton")
        for field in ("max", "sumexp", "zexp", "target"):
            torch.testing.assert_close(getattr(got, field), getattr(want, field), equal_nan=False)
    empty = row_stats(logits[:, :0], targets, valid, 0, 1.0, backend="torch")
    assert empty.max[0] == float("-inf") and empty.sumexp[0] == 0.0
