import math

import torch

from osvl.model.rope import (
    apply_rotary,
    mrope_axis_of_frequency,
    mrope_table,
    vision_rope_table,
)


def _mrope_reference(pos: torch.Tensor, head_dim: int, theta: float, sections) -> torch.Tensor:
    """Float64, element by element, from the interleaved MRoPE definition."""
    n = head_dim // 2
    T = pos.shape[1]
    out = torch.zeros(T, 2 * head_dim, dtype=torch.float64)
    for t in range(T):
        for i in range(n):
            axis = 1 if i % 3 == 1 and i < 3 * sections[1] else 2 if i % 3 == 2 and i < 3 * sections[2] else 0
            angle = float(pos[axis, t]) * theta ** (-2 * i / head_dim)
            for j in (i, i + n):
                out[t, j] = math.cos(angle)
                out[t, head_dim + j] = math.sin(angle)
    return out


def test_mrope_table_matches_float64_definition():
    pos = torch.randint(0, 300, (3, 11))
    got = mrope_table(pos, head_dim=16, theta=5e6, sections=(4, 2, 2))
    torch.testing.assert_close(got.double(), _mrope_reference(pos, 16, 5e6, (4, 2, 2)), rtol=0, atol=2e-5)


def test_mrope_axis_layout_for_qwen3_vl_sections():
    axis = mrope_axis_of_frequency(128, (24, 20, 20))
    assert axis.tolist()[:6] == [0, 1, 2, 0, 1, 2]
    assert [int((axis == a).sum()) for a in range(3)] == [24, 20, 20]
    assert axis[60:].tolist() == [0, 0, 0, 0]


def test_equal_axes_reduce_to_1d_rope():
    pos = torch.arange(9).view(1, -1).expand(3, -1)
    table = mrope_table(pos, head_dim=16, theta=1e4, sections=(4, 2, 2))
    inv = 1.0 / (1e4 ** (torch.arange(0, 16, 2).double() / 16))
    ang = torch.arange(9).double()[:, None] * inv
    torch.testing.assert_close(table[:, :8].double(), ang.cos(), rtol=0, atol=1e-6)


def test_vision_rope_table_uses_rows_then_columns():
    hw = torch.tensor([[0, 0], [3, 1]])
    table = vision_rope_table(hw, head_dim=8, theta=1e4)
    inv = 1.0 / (1e4 ** (torch.arange(0, 4, 2).double() / 4))
    angles = torch.cat([3 * inv, 1 * inv])
    torch.testing.assert_close(table[1, :4].double(), angles.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(table[1, 8:12].double(), angles.sin(), rtol=0, atol=1e-6)


def test_apply_rotary_preserves_norm_and_dtype():
    x = torch.randn(5, 3, 8, dtype=torch.bfloat16)
    table = mrope_table(torch.randint(0, 50, (3, 5)), head_dim=8, theta=1e4, sections=(2, 1, 1))
    y = apply_rotary(x, table)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float().norm(dim=-1), x.float().norm(dim=-1), rtol=2e-2, atol=2e-2)
