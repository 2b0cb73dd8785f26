from __future__ import annotations

import pytest
import torch

from osvl_kernels.integrations import pack, pack_layout, unpack


def test_pack_keeps_masked_positions_row_major_and_round_trips():
    mask = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0], [0, 1, 1, 0]], dtype=torch.bool)
    x = torch.arange(12.0).reshape(3, 4)
    layout = pack_layout(mask)
    assert layout.cu_seqlens.tolist() == [0, 3, 3, 5]
    assert pack(x, layout).tolist() == [0.0, 2.0, 3.0, 9.0, 10.0]
    back = unpack(pack(x, layout), layout, fill=-1.0)
    assert torch.equal(back, torch.where(mask, x, torch.full_like(x, -1.0)))


def test_pack_is_differentiable_and_keeps_trailing_dims():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    h = torch.randn(2, 3, 5, requires_grad=True)
    layout = pack_layout(mask)
    packed = pack(h, layout)
    assert packed.shape == (4, 5)
    packed.sum().backward()
    assert torch.equal(h.grad, mask[..., None].float().expand(2, 3, 5))


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="2-D"):
        pack_layout(torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool or integer"):
        pack_layout(torch.ones(2, 2))
    layout = pack_layout(torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[2, 3, \.\.\.\]"):
        pack(torch.zeros(3, 2), layout)
    with pytest.raises(ValueError, match="6 packed rows"):
        unpack(torch.zeros(5), layout)
