import pytest
import torch

from osvl.model import build_model, text_position_ids
from osvl.model.vision import interpolate_position_grid, merge_block_positions
from tests.model.tiny import IMAGE_TOKEN, tiny_config
from tests.model.tiny import image_batch as _image_batch


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_packed_documents_are_independent(moe):
    torch.manual_seed(0)
    config = tiny_config(moe)
    model = build_model(config).eval()
    grids = [(1, 4, 2), (1, 2, 2)]
    ids, cu, pos, px, grid, lengths = _image_batch(config, grids)
    with torch.no_grad():
        packed = model(ids, cu_seqlens=cu, position_ids=pos, pixel_values=px, image_grid_thw=grid)
        n0 = grids[0][1] * grids[0][2]
        alone = [
            model(
                ids[: lengths[0]],
                cu_seqlens=torch.tensor([0, lengths[0]]),
                position_ids=pos[:, : lengths[0]],
                pixel_values=px[:n0],
                image_grid_thw=grid[:1],
            ),
            model(
                ids[lengths[0] :],
                cu_seqlens=torch.tensor([0, lengths[1]]),
                position_ids=pos[:, lengths[0] :],
                pixel_values=px[n0:],
                image_grid_thw=grid[1:],
            ),
        ]
    assert packed.shape == (len(ids), config.text.vocab_size)
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)


def test_images_and_deepstack_change_only_later_tokens():
    torch.manual_seed(0)
    config = tiny_config()
    model = build_model(config).eval()
    ids, cu, pos, px, grid, _ = _image_batch(config, [(1, 2, 4)])
    with torch.no_grad():
        base = model(ids, cu_seqlens=cu, position_ids=pos, pixel_values=px, image_grid_thw=grid)
        other = model(ids, cu_seqlens=cu, position_ids=pos, pixel_values=px + 1, image_grid_thw=grid)
        for p in model.visual.deepstack_merger_list[1].parameters():
            p.mul_(1.5)
        deep = model(ids, cu_seqlens=cu, position_ids=pos, pixel_values=px, image_grid_thw=grid)
    first_image = int((ids == IMAGE_TOKEN).nonzero()[0])
    torch.testing.assert_close(base[:first_image], other[:first_image])  # causal: text before the image is unchanged
    assert (base[first_image:] - other[first_image:]).abs().max() > 1e-3
    assert (base[first_image:] - deep[first_image:]).abs().max() > 1e-4


def test_backward_reaches_vision_and_decoder():
    torch.manual_seed(0)
    config = tiny_config(moe=True)
    model = build_model(config)
    ids, cu, pos, px, grid, _ = _image_batch(config, [(1, 2, 2), (2, 2, 2)])
    model(ids, cu_seqlens=cu, position_ids=pos, pixel_values=px, image_grid_thw=grid).logsumexp(-1).sum().backward()
    for name in (
        "visual.patch_embed.proj.weight",
        "visual.deepstack_merger_list.0.linear_fc2.weight",
        "layers.0.attention.qkv_linear.wq.weight",
        "layers.1.moe.routed_experts.inner_experts.w1_EFD",
    ):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_return_hidden_and_text_positions():
    torch.manual_seed(0)
    model = build_model(tiny_config(tie=True)).eval()
    assert model.lm_head.weight is model.tok_embeddings.weight
    ids = torch.randint(10, 96, (9,))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    assert text_position_ids(cu, 9)[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4]
    with torch.no_grad():
        hidden = model(ids, cu_seqlens=cu, return_hidden=True)
        logits = model(ids, cu_seqlens=cu)
    assert hidden.shape == (9, 32)
    torch.testing.assert_close(model.lm_head(hidden), logits)


def test_meta_build_allocates_nothing():
    model = build_model(tiny_config(moe=True), device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(position_ids=torch.zeros(3, 5, dtype=torch.long)), r"position_ids must be \[3, 6\]"),
        (dict(cu_seqlens=torch.tensor([0, 7])), "end at 6"),
        (dict(pixel_values=torch.zeros(4, 24)), "given together"),
        (dict(pixel_values=torch.zeros(4, 24), image_grid_thw=torch.tensor([[1, 2, 2]])), "MRoPE position_ids"),
        (
            dict(
                pixel_values=torch.zeros(4, 24),
                image_grid_thw=torch.tensor([[1, 2, 2]]),
                position_ids=torch.zeros(3, 6, dtype=torch.long),
            ),
            "1 embeddings",
        ),
        (
            dict(
                pixel_values=torch.zeros(5, 24),
                image_grid_thw=torch.tensor([[1, 2, 2]]),
                position_ids=torch.zeros(3, 6, dtype=torch.long),
            ),
            r"pixel_values must be \[4, 24\]",
        ),
        (
            dict(
                pixel_values=torch.zeros(3, 24),
                image_grid_thw=torch.tensor([[1, 3, 1]]),
                position_ids=torch.zeros(3, 6, dtype=torch.long),
            ),
            "divisible by 2",
        ),
    ],
)
def test_bad_inputs_raise_value_error(kwargs, match):
    model = build_model(tiny_config()).eval()
    ids = torch.tensor([11, 12, IMAGE_TOKEN, IMAGE_TOKEN, 13, 14])
    args = dict(cu_seqlens=torch.tensor([0, 6], dtype=torch.int32)) | kwargs
    with pytest.raises(ValueError, match=match):
        model(ids, **args)
    with pytest.raises(ValueError, match="1-D integer"):
        model(ids.float(), cu_seqlens=args["cu_seqlens"])


def test_merge_block_order_and_grid_interpolation():
    pos = merge_block_positions(2, 4, 2)
    assert pos.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]
    table = torch.arange(16.0).view(16, 1)  # 4x4 grid holding its own raster index
    same = interpolate_position_grid(table, 4, 4, 1)
    torch.testing.assert_close(same, table)
    # align_corners=True: a 2x2 target samples the four corners
    assert interpolate_position_grid(table, 2, 2, 2).flatten().tolist() == [0.0, 3.0, 12.0, 15.0]
