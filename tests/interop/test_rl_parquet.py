import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from osvl.data.formats import FileStats, iter_rl_parquet, rl_prompt
from osvl.data.formats.records import Rejected
from osvl.rl.trajectory import FinishReason, Trajectory, append_jsonl, read_jsonl
from tests.interop.fixtures import png_bytes, rgb

IMAGE = rgb(20, 24, seed=5)


def verl_rows():
    good = {
        "data_source": "searchvl",
        "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "<image>Who built this?"}],
        "images": [{"bytes": png_bytes(IMAGE), "path": "x.png"}],
        "reward_model": {"style": "rule", "ground_truth": ["Thomas Telford", "Telford"]},
        "extra_info": {"index": "q7"},
    }
    bad_image = dict(good, images=[{"bytes": b"not a png", "path": "y.png"}])
    no_answer = dict(good, reward_model={"style": "rule", "ground_truth": None})
    return [good, bad_image, no_answer]


def test_verl_layout_streams_prompts_with_stats(tmp_path):
    path = tmp_path / "rl.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), path)
    stats = FileStats("rl")
    prompts = list(iter_rl_parquet(path, stats, batch_rows=1))
    assert len(prompts) == 1
    prompt = prompts[0]
    assert (prompt.id, prompt.question, prompt.answer, prompt.aliases) == (
        "q7",
        "Who built this?",
        "Thomas Telford",
        ["Telford"],
    )
    np.testing.assert_array_equal(prompt.images[0], IMAGE)
    assert stats.records == 1 and stats.images == 1 and dict(stats.rejected) == {"bad image": 1, "no answer": 1}

    traj = Trajectory(prompt=prompt, steps=[], finish_reason=FinishReason.MAX_TURNS, group_id=0, sample_index=0)
    append_jsonl(tmp_path / "p.jsonl", [traj])
    back = next(read_jsonl(tmp_path / "p.jsonl")).prompt
    assert back.accepted_answers == ["Thomas Telford", "Telford"]
    np.testing.assert_array_equal(back.images[0], IMAGE)


def test_release_hf_layout(tmp_path):
    rows = [
        {"id": 3, "question": "Which river?", "answer": "Ness", "image": png_bytes(IMAGE)},
        {"id": 4, "question": "  ", "answer": "x", "image": None},
    ]
    path = tmp_path / "hf.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    stats = FileStats("hf")
    (prompt,) = list(iter_rl_parquet(path, stats))
    assert (prompt.id, prompt.question, prompt.answer, len(prompt.images)) == ("3", "Which river?", "Ness", 1)
    assert dict(stats.rejected) == {"empty question": 1}


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"text": "?"}, "unknown layout"),
        ({"question": "q", "answer": {"a": 1}}, "bad answer"),
        ({"prompt": [{"role": "assistant", "content": "hi"}], "reward_model": {"ground_truth": "a"}}, "bad prompt"),
        ({"question": "<image><image>q", "answer": "a", "images": [png_bytes(IMAGE)]}, "image count mismatch"),
        ({"question": "q", "answer": "a", "images": ["path.png"]}, "bad image"),
    ],
)
def test_bad_rows_are_rejected_with_reasons(row, reason):
    with pytest.raises(Rejected) as info:
        rl_prompt(row, "r0")
    assert info.value.reason == reason


def test_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        list(iter_rl_parquet(tmp_path / "none.parquet"))
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="not a readable parquet"):
        list(iter_rl_parquet(junk))
    with pytest.raises(ValueError, match="batch_rows"):
        list(iter_rl_parquet(junk, batch_rows=0))
