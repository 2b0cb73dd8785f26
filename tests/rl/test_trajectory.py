"""Trajectory records: validation and a lossless JSONL + PNG round trip."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from osvl.rl.trajectory import (
    FinishReason,
    ImageStore,
    Prompt,
    RewardParts,
    Step,
    ToolCall,
    ToolResult,
    ToolStatus,
    Trajectory,
    append_jsonl,
    default_images_dir,
    image_hashes,
    image_sha256,
    read_jsonl,
    read_prompts,
    trajectory_from_dict,
    write_prompts,
)

from .helpers import PROMPT, response_step, rgb, tool_step


def assert_same(a, b) -> None:
    """Deep equality that compares numpy images exactly and floats bit for bit."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b)
    elif isinstance(a, float):
        assert isinstance(b, float)
        assert struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif hasattr(a, "__dataclass_fields__"):
        assert type(a) is type(b)
        for name in a.__dataclass_fields__:
            assert_same(getattr(a, name), getattr(b, name))
    else:
        assert a == b and type(a) is type(b)


def rich_trajectory() -> Trajectory:
    photo, crop = rgb(17, 23, 0), rgb(5, 4, 1)
    prompt = Prompt(
        id="q-ü-1",
        question="Какой год? 这座桥 🌉 opened when?",
        images=[photo],
        answer="1982",
        aliases=["MCMLXXXII", "一九八二"],
    )
    crop_step = Step(
        token_ids=[151644, 0, 42],
        logprobs=[-0.1, -1e-300, -12.345678901234567],
        text='<think>zoom 🔍</think><tool_call>{"name": "crop"}</tool_call>',
        think="zoom 🔍",
        tool_call=ToolCall("crop", {"bbox": [0, 0, 4, 5], "nested": {"ok": True, "x": None}}),
        tool_result=ToolResult(status="ok", tool="crop", text="", images=[crop], elapsed_s=0.0125),
        observation_text="<image>",
        observation_images=[crop, photo],
        observation_token_ids=[9, 9, 9],
        policy_version=3,
    )
    failed = Step(
        token_ids=[5],
        logprobs=[float("-inf")],
        text="<think>x</think><tool_call>{",
        tool_result=ToolResult(status=ToolStatus.PARSE_ERROR, tool="", error="Expecting value: line 1 column 2"),
        policy_version=4,
    )
    empty = Step(token_ids=[], logprobs=[])
    return Trajectory(
        prompt=prompt,
        steps=[crop_step, failed, empty, response_step("1982 — ok")],
        finish_reason=FinishReason.RESPONSE,
        group_id=7,
        sample_index=3,
        fatal_step=-1,
        reward=RewardParts(fmt=0.75, acc=1.0, query=0.1 + 0.2, total=0.8600000000000001),
        infra_retries=2,
    )


def test_round_trip_is_lossless(tmp_path) -> None:
    original = [
        rich_trajectory(),
        Trajectory(
            prompt=PROMPT,
            steps=[],
            finish_reason="max_turns",
            group_id=0,
            sample_index=0,
            fatal_step=0,
            reward=RewardParts(fmt=0.0, acc=None, query=None, total=None, unscored_reason="accuracy:timeout"),
        ),
    ]
    path = tmp_path / "run" / "rollouts.jsonl"
    assert append_jsonl(path, original) == 2
    loaded = list(read_jsonl(path))
    assert len(loaded) == 2
    for a, b in zip(original, loaded):
        assert_same(a, b)


def test_a_prompts_anchor_and_hops_survive_both_files(tmp_path) -> None:
    anchored = Prompt(id="drill-image-Ostrava-country-population", question="q?", answer="7", anchor="Ostrava", hops=1)
    plain = Prompt(id="p1", question="q?", answer="8")
    assert write_prompts(tmp_path / "prompts.jsonl", [anchored, plain]) == 2
    assert list(read_prompts(tmp_path / "prompts.jsonl")) == [anchored, plain]
    assert "anchor" not in (tmp_path / "prompts.jsonl").read_text().splitlines()[1]  # old files read the same
    record = Trajectory(prompt=anchored, steps=[], finish_reason="response", group_id=0, sample_index=0)
    append_jsonl(tmp_path / "rollouts.jsonl", [record])
    assert next(read_jsonl(tmp_path / "rollouts.jsonl")).prompt == anchored
    with pytest.raises(ValueError, match="hops must be >= 0"):
        Prompt(id="p", question="q", hops=-1)


def test_images_are_stored_once_per_content(tmp_path) -> None:
    path = tmp_path / "rollouts.jsonl"
    append_jsonl(path, [rich_trajectory(), rich_trajectory()])
    files = sorted(p.name for p in default_images_dir(path).iterdir())
    # the photo appears in the prompt and an observation, the crop in a result and an observation
    assert len(files) == 2
    assert {f.removesuffix(".png") for f in files} == {image_sha256(rgb(17, 23, 0)), image_sha256(rgb(5, 4, 1))}
    line = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
    assert line["prompt"]["images"] == [image_sha256(rgb(17, 23, 0))]
    assert "Какой год" in path.read_text(encoding="utf-8")  # unicode stays readable


def test_a_record_reads_without_its_images_and_names_them_by_hash(tmp_path) -> None:
    path = tmp_path / "rollouts.jsonl"
    append_jsonl(path, [rich_trajectory()])
    record = json.loads(path.read_text(encoding="utf-8"))
    photo, crop = image_sha256(rgb(17, 23, 0)), image_sha256(rgb(5, 4, 1))
    assert image_hashes(record) == ([photo], [[crop, photo], [], [], []])  # the result's images are not rendered
    bare = trajectory_from_dict(record, store=None)
    full = next(read_jsonl(path))
    assert bare.prompt.images == [] and all(s.observation_images == [] for s in bare.steps)
    assert bare.steps[0].tool_result.images == [] and full.steps[0].tool_result.images
    assert [s.token_ids for s in bare.steps] == [s.token_ids for s in full.steps]
    record["steps"][0]["observation_images"] = ["../../etc/passwd"]
    with pytest.raises(ValueError, match="image reference '../../etc/passwd' is not a SHA-256 hex digest"):
        image_hashes(record)


def test_rgb_order_survives_png(tmp_path) -> None:
    red = np.zeros((2, 2, 3), dtype=np.uint8)
    red[..., 0] = 255
    store = ImageStore(tmp_path)
    assert store.get(store.put(red))[0, 0].tolist() == [255, 0, 0]


def test_tampered_image_is_detected(tmp_path) -> None:
    store = ImageStore(tmp_path)
    sha = store.put(rgb(3, 3, 5))
    other = ImageStore(tmp_path / "other")
    (tmp_path / f"{sha}.png").write_bytes((tmp_path / "other" / f"{other.put(rgb(3, 3, 6))}.png").read_bytes())
    with pytest.raises(ValueError, match="content hash"):
        store.get(sha)


def test_same_pixels_different_shape_differ() -> None:
    flat = np.arange(12, dtype=np.uint8).reshape(1, 4, 3)
    assert image_sha256(flat) != image_sha256(flat.reshape(2, 2, 3))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    logprobs=st.lists(st.floats(allow_nan=False, max_value=0.0), max_size=20),
    text=st.text(max_size=50),
    version=st.integers(0, 2**40),
)
def test_floats_and_text_round_trip_exactly(tmp_path, logprobs, text, version) -> None:
    step = Step(
        token_ids=list(range(len(logprobs))),
        logprobs=logprobs,
        text=text,
        think=text,
        observation_text=text,
        policy_version=version,
    )
    traj = Trajectory(
        prompt=Prompt(id=text, question=text), steps=[step], finish_reason="max_tokens", group_id=1, sample_index=2
    )
    path = tmp_path / f"{abs(hash((tuple(logprobs), text, version)))}.jsonl"
    append_jsonl(path, [traj])
    assert_same(traj, next(read_jsonl(path)))


@pytest.mark.parametrize(
    "image, message",
    [
        (np.zeros((2, 2, 3), dtype=np.float32), "uint8"),
        (np.zeros((2, 2), dtype=np.uint8), "shape"),
        (np.zeros((2, 2, 4), dtype=np.uint8), "shape"),
        (np.zeros((0, 2, 3), dtype=np.uint8), "shape"),
        ([[0, 0, 0]], "uint8"),
    ],
)
def test_bad_images_rejected(image, message) -> None:
    with pytest.raises(ValueError, match=message):
        ToolResult(status="ok", tool="crop", images=[image])


def test_bad_records_rejected() -> None:
    with pytest.raises(ValueError, match="unknown tool status 'crashed'"):
        ToolResult(status="crashed", tool="x")
    with pytest.raises(ValueError, match="differ in length"):
        Step(token_ids=[1, 2], logprobs=[0.0])
    with pytest.raises(ValueError):
        Trajectory(prompt=PROMPT, steps=[], finish_reason="gave_up", group_id=0, sample_index=0)


def test_unknown_schema_rejected(tmp_path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"schema": 99}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="unsupported trajectory schema 99"):
        list(read_jsonl(path))


def test_derived_properties() -> None:
    traj = Trajectory(
        prompt=PROMPT,
        steps=[tool_step("timeout"), tool_step(None), response_step("x")],
        finish_reason="response",
        group_id=0,
        sample_index=0,
    )
    assert traj.final_answer == "x"
    assert traj.statuses == [ToolStatus.TIMEOUT, None, None]
    assert (
        Trajectory(
            prompt=PROMPT, steps=[tool_step()], finish_reason="max_turns", group_id=0, sample_index=0
        ).final_answer
        is None
    )
    assert PROMPT.accepted_answers == ["1982", "nineteen eighty-two"]
