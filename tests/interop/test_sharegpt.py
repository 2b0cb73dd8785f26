import copy
import json

import numpy as np
import pytest

from osvl.data import ChatRenderer, ImageConfig, train_bpe_tokenizer
from osvl.data.formats import FileStats, iter_sharegpt, tokenize_steps
from osvl.rl.trajectory import ToolStatus, append_jsonl, read_jsonl
from tests.interop.fixtures import (
    SYSTEM,
    function_call_record,
    release_record,
    rgb,
    write_png,
)

QUESTION, CROP = rgb(48, 64, seed=1), rgb(16, 16, seed=2)


@pytest.fixture(scope="module")
def tokenizer():
    corpus = [json.dumps(release_record("a", "b")), json.dumps(function_call_record()), SYSTEM] * 10
    return train_bpe_tokenizer(corpus, vocab_size=600)


@pytest.fixture()
def dataset(tmp_path):
    write_png(tmp_path / "images" / "q.png", QUESTION)
    write_png(tmp_path / "images" / "c.png", CROP)
    good = release_record("images/q.png", str(tmp_path / "images" / "c.png"))  # relative and absolute
    missing = release_record("images/q.png", "images/gone.png")
    mismatch = release_record("images/q.png", "images/c.png")
    mismatch["images"] = ["images/q.png"]
    no_answer = copy.deepcopy(good)
    no_answer["conversations"] = no_answer["conversations"][:-1]
    bad_call = copy.deepcopy(good)
    bad_call["conversations"][1]["value"] = "<think>x</think><tool_call>{oops</tool_call>"
    records = [good, missing, function_call_record(), mismatch, no_answer, bad_call, ["not", "a", "record"]]
    (tmp_path / "sft.json").write_text(json.dumps(records, indent=1))
    (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return tmp_path


@pytest.mark.parametrize("name", ["sft.json", "sft.jsonl"])
def test_records_steps_images_and_statistics(dataset, name):
    stats = FileStats(name)
    records = list(iter_sharegpt(dataset / name, stats))
    assert len(records) == 2
    first, second = records[0].trajectory, records[1].trajectory
    assert first.prompt.question == "Which year did the bridge in the picture open?"
    np.testing.assert_array_equal(first.prompt.images[0], QUESTION)
    assert [s.tool_call.name if s.tool_call else None for s in first.steps] == ["crop", "text_search", None]
    assert first.steps[0].tool_call.arguments == {"image": "img_1", "x": 0, "y": 0, "width": 8, "height": 8}
    np.testing.assert_array_equal(first.steps[0].observation_images[0], CROP)
    assert first.steps[0].observation_text.startswith("Image cropped successfully")
    assert first.steps[1].observation_text == "The Kessock Bridge opened in 1982."
    assert first.final_answer == "1982" and first.steps[0].think == "Zoom on the sign."
    assert records[0].system == SYSTEM and [t["function"]["name"] for t in records[0].tools] == ["crop", "text_search"]
    assert second.statuses == [ToolStatus.TOOL_ERROR, ToolStatus.OK, None]
    assert second.steps[0].text.startswith("<tool_call>\n{") and second.steps[0].tool_call.arguments == {"q": "Kessock"}
    assert (stats.records, stats.turns, stats.tool_calls, stats.images) == (2, 6, 4, 2)
    assert stats.tool_calls_per_trajectory == 2.0
    assert dict(stats.rejected) == {
        "missing image": 1,
        "image count mismatch": 1,
        "no final response": 1,
        "bad tool call": 1,
        "not an object": 1,
    }
    assert "gone.png" in stats.examples["missing image"] and stats.summary()["records"] == 2


def test_records_render_to_token_ids_and_round_trip_through_jsonl(dataset, tokenizer, tmp_path):
    stats = FileStats("sft")
    record = next(iter_sharegpt(dataset / "sft.jsonl", stats, tokenizer=tokenizer))
    traj = tokenize_steps(record.trajectory, tokenizer)
    renderer = ChatRenderer(
        tokenizer, ImageConfig(min_pixels=32 * 32, max_pixels=64 * 64), tools=record.tools, system_prompt=record.system
    )
    rendered = renderer.render_trajectory(traj)
    policy = rendered.input_ids[rendered.loss_mask]
    expected = [i for s in record.trajectory.steps for i in [*tokenizer.encode(s.text), tokenizer.special.im_end]]
    assert policy.tolist() == expected and stats.tokens == len(expected)
    text = tokenizer.decode(rendered.input_ids.tolist())
    assert text.count("<|im_start|>assistant") == 3 and SYSTEM in text and '"name": "crop"' in text
    assert len(rendered.images) == 2  # question image, then the crop the tool returned
    assert int((rendered.input_ids == tokenizer.special.image_pad).sum()) == sum(i.num_tokens for i in rendered.images)

    out = tmp_path / "out" / "trajectories.jsonl"
    append_jsonl(out, [traj])
    (back,) = list(read_jsonl(out))
    assert [s.token_ids for s in back.steps] == [s.token_ids for s in traj.steps]
    np.testing.assert_array_equal(back.steps[0].observation_images[0], CROP)
    assert renderer.render_trajectory(back).input_ids.tolist() == rendered.input_ids.tolist()


def test_tokenize_steps_refuses_engine_steps(dataset, tokenizer):
    traj = tokenize_steps(next(iter_sharegpt(dataset / "sft.json")).trajectory, tokenizer)
    with pytest.raises(ValueError, match="already has token ids"):
        tokenize_steps(traj, tokenizer)


def test_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        list(iter_sharegpt(tmp_path / "none.json"))
    broken = tmp_path / "broken.json"
    broken.write_text('[{"conversations": []}, {"conversations": [')
    with pytest.raises(ValueError, match="malformed JSON"):
        list(iter_sharegpt(broken))


def test_json_array_streams_across_small_chunks(dataset):
    from osvl.data.formats.sharegpt import _json_objects

    with open(dataset / "sft.json", encoding="utf-8") as handle:
        streamed = list(_json_objects(handle, chunk_chars=7))
    assert streamed == json.loads((dataset / "sft.json").read_text())


def test_tokenize_steps_keeps_engine_steps_when_asked(dataset, tokenizer):
    text_only = next(iter_sharegpt(dataset / "sft.json")).trajectory
    recorded = tokenize_steps(text_only, tokenizer)
    mixed = copy.deepcopy(text_only)
    mixed.steps[0] = recorded.steps[0]  # an engine-recorded step next to text-only ones
    kept = tokenize_steps(mixed, tokenizer, keep_token_ids=True)
    assert kept.steps[0] is mixed.steps[0]
    assert [s.token_ids for s in kept.steps] == [s.token_ids for s in recorded.steps]
    assert all(s.logprobs == [0.0] * len(s.token_ids) for s in kept.steps)
    with pytest.raises(ValueError, match=r"step 0 already has token ids"):
        tokenize_steps(mixed, tokenizer)


def test_tokenize_steps_refuses_a_step_without_ids_or_text(dataset, tokenizer):
    traj = copy.deepcopy(next(iter_sharegpt(dataset / "sft.json")).trajectory)
    traj.steps[-1].text = ""
    for keep in (False, True):
        with pytest.raises(ValueError, match=r"step \d+ has neither token ids nor text"):
            tokenize_steps(traj, tokenizer, keep_token_ids=keep)
