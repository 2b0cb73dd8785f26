import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from osvl.model import attention
from osvl.model.attention import VarlenAttention, packed_attention, packed_metadata


def _dense_reference(q, k, v, cu, causal):
    """Float64 masked attention over the whole packed row."""
    T = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(torch.tensor(cu)))
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= torch.ones(T, T, dtype=torch.bool).tril()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qnh,knh->nqk", q.double(), k.double()) / q.shape[-1] ** 0.5
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("nqk,knh->qnh", s.softmax(-1), v.double())


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_backend_matches_float64_masked_attention(causal):
    cu = [0, 3, 10, 11]
    q, k, v = torch.randn(11, 4, 8), torch.randn(11, 2, 8), torch.randn(11, 2, 8)
    meta = packed_metadata(torch.tensor(cu, dtype=torch.int32), 11)
    out = packed_attention(q, k, v, meta, causal=causal, scale=None, backend="sdpa")
    torch.testing.assert_close(out.double(), _dense_reference(q, k, v, cu, causal), rtol=1e-5, atol=1e-5)


def test_sdpa_backend_gqa_gradients_match_float64():
    """KV heads shared by copy on CPU: the gradient of each KV head sums over its query group."""
    cu = [0, 5, 12]
    q, k, v = (torch.randn(12, n, 8, dtype=torch.float32, requires_grad=True) for n in (6, 2, 2))
    meta = packed_metadata(torch.tensor(cu, dtype=torch.int32), 12)
    weight = torch.randn(12, 6, 8)
    (packed_attention(q, k, v, meta, causal=True, scale=None, backend="sdpa") * weight).sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    (_dense_reference(q64, k64, v64, cu, causal=True) * weight.double()).sum().backward()
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_sdpa_backend_backward_runs_on_cpu():
    q = torch.randn(7, 2, 4, requires_grad=True)
    meta = packed_metadata(torch.tensor([0, 4, 7]), 7)
    packed_attention(q, q, q, meta, causal=True, scale=None, backend="sdpa").pow(2).sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0


def test_sdpa_backend_takes_the_fused_cpu_kernel_forward_and_backward():
    """Per-document SDPA on 4-D inputs, so torch's fused CPU attention runs rather than the math path
    (the math path took ~30% of an SFT step of the demo's policy)."""
    cu = [0, 9, 20]
    q, k, v = (torch.randn(20, 4, 8, requires_grad=True) for _ in range(3))
    meta = packed_metadata(torch.tensor(cu, dtype=torch.int32), 20)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        packed_attention(q, k, v, meta, causal=True, scale=None, backend="sdpa").sum().backward()
    ops = {event.key for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops, sorted(ops)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in ops, sorted(ops)
    assert "aten::_scaled_dot_product_attention_math" not in ops


@pytest.mark.parametrize(
    "cu, total, match",
    [
        ([0, 3, 2, 5], 5, "strictly increasing"),
        ([1, 5], 5, "start at 0"),
        ([0, 4], 5, "end at 5"),
        ([0], 0, ">= 2 entries"),
    ],
)
def test_packed_metadata_rejects_bad_cu_seqlens(cu, total, match):
    with pytest.raises(ValueError, match=match):
        packed_metadata(torch.tensor(cu), total)


def test_packed_metadata_rejects_float_and_bad_backend():
    with pytest.raises(ValueError, match="int32 or int64"):
        packed_metadata(torch.tensor([0.0, 2.0]), 2)
    meta = packed_metadata(torch.tensor([0, 2]), 2)
    x = torch.randn(2, 1, 4)
    with pytest.raises(ValueError, match="needs CUDA"):
        packed_attention(x, x, x, meta, causal=True, scale=None, backend="varlen")
    with pytest.raises(ValueError, match="unknown attention backend"):
        packed_attention(x, x, x, meta, causal=True, scale=None, backend="flash9")


def _fake_cuda_inputs(heads_q: int, heads_kv: int, cu: list[int]):
    """Fake CUDA q, k, v (no device needed) and metadata whose offsets live on that fake device."""
    with unset_fake_temporarily():  # the metadata reads the offsets on the host
        meta = packed_metadata(torch.tensor(cu, dtype=torch.int32), cu[-1])
    T, D = cu[-1], 8
    q = torch.empty(T, heads_q, D, device="cuda")
    k, v = torch.empty(T, heads_kv, D, device="cuda"), torch.empty(T, heads_kv, D, device="cuda")
    cu_cuda = torch.tensor(cu, dtype=torch.int32, device="cuda")
    return q, k, v, meta._replace(cu_seq_q=cu_cuda, cu_seq_k=cu_cuda)


def torch_2_11_varlen_attn(calls: list[dict]):
    """A stand-in with exactly torch 2.11's public signature (the GPU image's: no enable_gqa keyword)
    that records each call."""

    def varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
    ):
        dtypes = {t.dtype for t in (query, key, value)}
        calls.append(
            dict(dtypes=dtypes, heads=(query.shape[1], key.shape[1]), max_q=max_q, scale=scale, window=window_size)
        )
        return torch.empty_like(query)

    return varlen_attn


@pytest.mark.parametrize("causal, window", [(True, (-1, 0)), (False, (-1, -1))])
def test_varlen_backend_calls_torch_2_11_signature(monkeypatch, causal, window):
    """Text layers (GQA, causal) and vision blocks (equal heads, bidirectional) on torch 2.11's varlen_attn."""
    calls = []
    monkeypatch.setattr(attention, "INSTALLED_VARLEN", VarlenAttention(torch_2_11_varlen_attn(calls)))
    with FakeTensorMode():
        for heads_kv in (2, 4):
            q, k, v, meta = _fake_cuda_inputs(4, heads_kv, [0, 3, 10, 11])
            out = packed_attention(q, k, v, meta, causal=causal, scale=0.5, backend="varlen")
            assert (out.shape, out.dtype, out.device.type) == ((11, 4, 8), torch.float32, "cuda")
    assert calls == [
        dict(dtypes={torch.bfloat16}, heads=(4, heads_kv), max_q=7, scale=0.5, window=window) for heads_kv in (2, 4)
    ]


def test_varlen_backend_runs_the_installed_torch_varlen_attn():
    """The real varlen_attn (its fake-tensor kernel): torch >= 2.12 raises on GQA without enable_gqa=True,
    torch 2.11 on the keyword itself, so a call the installed torch does not take fails here."""
    with FakeTensorMode():
        for heads_kv in (2, 4):
            q, k, v, meta = _fake_cuda_inputs(4, heads_kv, [0, 5, 12])
            out = packed_attention(q, k, v, meta, causal=True, scale=None, backend="varlen")
            assert (out.shape, out.dtype) == ((12, 4, 8), torch.float32)


def test_varlen_backend_rejects_heads_that_do_not_group():
    with FakeTensorMode():
        q, k, v, meta = _fake_cuda_inputs(3, 2, [0, 4])
        with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of key/value heads \(2\)"):
            packed_attention(q, k, v, meta, causal=True, scale=None, backend="varlen")
