"""3-D MRoPE positions: parity with transformers' Qwen3-VL get_rope_index, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from osvl.data.mrope import mrope_position_ids

IMAGE, VIDEO, START, END = 60, 61, 62, 63


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    torch.manual_seed(0)
    config = Qwen3VLConfig(
        text_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            vocab_size=64,
            rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=16,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            deepstack_visual_indexes=[0],
            num_position_embeddings=16,
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    return Qwen3VLModel(config).eval()


def conversation(rng: np.random.Generator, num_images: int) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Text, then per image: text, <vision_start>, pads, <vision_end>; then trailing text."""
    ids: list[int] = list(rng.integers(0, 50, size=rng.integers(1, 6)))
    grids = []
    for _ in range(num_images):
        grid = (1, 2 * int(rng.integers(1, 6)), 2 * int(rng.integers(1, 6)))
        grids.append(grid)
        ids += list(rng.integers(0, 50, size=rng.integers(0, 4)))
        ids += [START] + [IMAGE] * (grid[1] * grid[2] // 4) + [END]
    ids += list(rng.integers(0, 50, size=rng.integers(0, 6)))
    return np.asarray(ids, dtype=np.int64), grids


@pytest.mark.parametrize("seed", range(12))
def test_matches_transformers_get_rope_index(hf_model, seed):
    rng = np.random.default_rng(seed)
    ids, grids = conversation(rng, num_images=seed % 4)
    ours = mrope_position_ids(ids, grids, IMAGE, merge_size=2)
    input_ids = torch.from_numpy(ids)[None]
    theirs, _ = hf_model.get_rope_index(
        input_ids, (input_ids == IMAGE).int(), image_grid_thw=torch.tensor(grids) if grids else None
    )
    np.testing.assert_array_equal(ours, theirs[:, 0].numpy())


def test_worked_example():
    ids = [1, 2, START] + [IMAGE] * 6 + [END, 5]
    positions = mrope_position_ids(ids, [(1, 4, 6)], IMAGE)
    assert positions.tolist() == [
        [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7],
        [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7],
        [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7],
    ]


def test_adjacent_images_are_split_by_their_grids():
    ids = [START] + [IMAGE] * 2 + [IMAGE] * 4 + [END]
    positions = mrope_position_ids(ids, [(1, 2, 4), (1, 4, 4)], IMAGE)
    assert positions.tolist() == [
        [0, 1, 1, 3, 3, 3, 3, 5],
        [0, 1, 1, 3, 3, 4, 4, 5],
        [0, 1, 2, 3, 4, 3, 4, 5],
    ]


def test_text_only_is_arange():
    assert np.array_equal(mrope_position_ids([4, 5, 6], [], IMAGE), np.tile(np.arange(3), (3, 1)))


@pytest.mark.parametrize(
    "ids, grids, match",
    [
        ([START, IMAGE, IMAGE, END], [(1, 4, 4)], "needs 4 image tokens"),
        ([START, IMAGE, IMAGE, END], [], "no image_grid_thw"),
        ([IMAGE, 7, IMAGE, IMAGE, IMAGE], [(1, 4, 2), (1, 2, 2)], "not contiguous"),
        ([IMAGE], [(1, 3, 2)], "multiple of merge"),
    ],
)
def test_mismatched_grids_raise(ids, grids, match):
    with pytest.raises(ValueError, match=match):
        mrope_position_ids(ids, grids, IMAGE)


def test_rejects_2d_ids():
    with pytest.raises(ValueError, match="1-D"):
        mrope_position_ids(np.zeros((2, 3), np.int64), [], IMAGE)
