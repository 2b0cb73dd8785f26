"""Shape/dtype checks of the logits- and hidden-state entry points: accepted inputs pass, each bad
input raises a ValueError that names it."""

from __future__ import annotations

import pytest
import torch

from osvl_kernels.inputs import check_linear_inputs, check_logits_inputs


def test_check_logits_inputs_accepts_every_float_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        check_logits_inputs(torch.zeros(3, 5, dtype=dtype), torch.tensor([0, 4, 2]))


@pytest.mark.parametrize(
    "logits, target_ids, message",
    [
        (torch.zeros(3), torch.tensor([0, 1, 2]), r"logits must be a 2-D \[T, V\] tensor, got \(3,\)"),
        ([[0.0]], torch.tensor([0]), "logits must be a 2-D .* got list"),
        (torch.zeros(3, 5, dtype=torch.int32), torch.tensor([0, 1, 2]), "logits must be fp32/bf16/fp16"),
        (torch.zeros(3, 5), torch.tensor([0, 1]), r"target_ids must have shape \[3\]"),
        (torch.zeros(3, 5), torch.tensor([0.0, 1.0, 2.0]), "target_ids must be a int tensor"),
    ],
)
def test_check_logits_inputs_rejects(logits, target_ids, message):
    with pytest.raises(ValueError, match=message):
        check_logits_inputs(logits, target_ids)


def test_check_linear_inputs_accepts_every_float_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        check_linear_inputs(torch.zeros(3, 4, dtype=dtype), torch.zeros(5, 4, dtype=dtype), torch.tensor([0, 4, 2]))


H = torch.zeros(3, 4)
W = torch.zeros(5, 4)
IDS = torch.tensor([0, 4, 2])


@pytest.mark.parametrize(
    "hidden, weight, target_ids, message",
    [
        (torch.zeros(2, 3, 4), W, IDS, r"hidden must be a 2-D \[T, H\] tensor, got \(2, 3, 4\)"),
        (H, "w", IDS, r"weight must be a 2-D \[V, H\] tensor, got str"),
        (H.long(), W.long(), IDS, "hidden must be fp32/bf16/fp16"),
        (H, W.half(), IDS, "weight dtype torch.float16 must match hidden dtype torch.float32"),
        (H, torch.zeros(5, 3), IDS, r"hidden size mismatch: hidden is \[T, 4\], weight is \[V, 3\]"),
        (H, torch.zeros(0, 4), IDS, "weight has no vocab rows"),
        (H, torch.zeros(5, 4, device="meta"), IDS, "weight is on meta, hidden on cpu"),
        (H, W, torch.tensor([0, 1]), r"target_ids must have shape \[3\]"),
        (H, W, torch.zeros(3, dtype=torch.long, device="meta"), "target_ids is on meta, expected cpu"),
        (H, W, torch.tensor([True, False, True]), "target_ids must be a int tensor"),
    ],
)
def test_check_linear_inputs_rejects(hidden, weight, target_ids, message):
    with pytest.raises(ValueError, match=message):
        check_linear_inputs(hidden, weight, target_ids)
