import json

import numpy as np
import pytest

from osvl.eval.benchmarks import FORMATS, Rejected, convert, get_format, load_benchmark
from osvl.eval.items import EvalItem, read_image_ref, to_prompt
from osvl.rl.trajectory import Prompt, write_prompts
from tests.eval.helpers import b64, rgb, write_jsonl, write_png


def test_every_paper_benchmark_loads_its_released_fields(tmp_path):
    image = rgb(seed=1)
    write_png(tmp_path / "img" / "a.png", image)
    write_png(tmp_path / "oven_0001.JPEG", image)
    rows = {
        "simplevqa": {
            "data_id": 7,
            "image": b64(image),
            "question": "Who built it?",
            "answer": "Ada",
            "language": "EN",
            "vqa_category": "art",
        },
        "vdr": {
            "id": "v1",
            "question": "Which year?",
            "answer": "1901",
            "answers": ["1901", "nineteen-oh-one"],
            "images": ["img/a.png"],
        },
        "mmsearch": {
            "sample_id": "m1",
            "query": "What won?",
            "gt_answer": "Blue",
            "alternative_gt_answers": ["blue team"],
            "query_image": {"bytes": b64(image), "path": None},
            "area": "sports",
            "subfield": "f1",
        },
        "livevqa": {
            "id": "l1",
            "img_path": "img/a.png",
            "source": "BBC UK",
            "level1_qa": {
                "question": "Where?",
                "question_type": "location",
                "options": ["A. Oslo"],
                "Ground_Truth": "A",
                "Ground_Truth_List": ["Oslo"],
                "img_path": "img/a.png",
                "img_url": "https://example.com/a.jpg",
            },
        },
        "browsecomp_vl": {
            "id": "b1",
            "question": "Whose?",
            "answer": "Bo",
            "image": "data:image/png;base64," + b64(image),
            "level": "2",
        },
        "fvqa": {
            "data_id": "fvqa_test_3",
            "question": "What is it used for?",
            "answer": "cutting",
            "images": [{"bytes": b64(image), "path": None}],
            "category": "object",
            "data_source": "fvqa",
        },
        "infoseek": {
            "data_id": "infoseek_val_1",
            "image_id": "oven_0001",
            "question": "How tall?",
            "answer": [120, "120 m"],
            "answer_eval": [{"wikidata": 120.0, "range": [108.0, 132.0]}],
            "data_split": "val_unseen_question",
        },
    }
    for name, row in rows.items():
        report = load_benchmark(write_jsonl(tmp_path / f"{name}.jsonl", [row]), name, tmp_path)
        assert not report.rejected, (name, report.examples)
        [item] = report.items
        assert item.benchmark == name and item.question.endswith("?") and item.answers
        assert len(item.images) == 1 and np.array_equal(read_image_ref(item.images[0]), image), name
    assert load_benchmark(tmp_path / "infoseek.jsonl", "infoseek").items[0].answers == ("120", "120 m", "120.0")
    mm = load_benchmark(tmp_path / "mmsearch.jsonl", "mmsearch").items[0]
    assert mm.answers == ("Blue", "blue team") and mm.meta == {"area": "sports", "subfield": "f1"}
    assert {f.column for f in FORMATS.values()} - {None} == {
        "SimpleVQA",
        "VDR",
        "MMSearch",
        "LiveVQA",
        "BrowseComp-VL",
        "FVQA",
        "InfoSeek",
    }


def test_bad_lines_are_counted_rejections_and_good_lines_survive(tmp_path):
    write_png(tmp_path / "ok.png", rgb())
    rows = [
        {"id": "good", "question": "Q?", "answer": "A", "image": "ok.png"},
        "{not json",
        [1, 2],
        {"question": "Q?", "answer": "A", "image": "ok.png"},
        {"id": "no-q", "question": "  ", "answer": "A", "image": "ok.png"},
        {"id": "no-a", "question": "Q?", "image": "ok.png"},
        {"id": "dict-a", "question": "Q?", "answer": {"range": [1, 2]}, "image": "ok.png"},
        {"id": "gone", "question": "Q?", "answer": "A", "image": "missing.png"},
        {"id": "web", "question": "Q?", "answer": "A", "image": "https://example.com/x.jpg"},
        {"id": "no-img", "question": "Q?", "answer": "A"},
        {"id": "good", "question": "Q again?", "answer": "B", "image": "ok.png"},
    ]
    report = load_benchmark(write_jsonl(tmp_path / "b.jsonl", rows), "vdr")
    assert [i.id for i in report.items] == ["good"]
    assert dict(report.rejected) == {
        "invalid_json": 1,
        "not_an_object": 1,
        "missing_id": 1,
        "missing_question": 1,
        "missing_answer": 1,
        "answer_not_text": 1,
        "image_not_found": 1,
        "remote_image": 1,
        "missing_image": 1,
        "duplicate_id": 1,
    }
    assert report.examples[0].startswith("line 2: invalid_json") and report.to_dict()["items"] == 1


def test_text_only_mmsearch_queries_are_allowed_and_relabelling_keeps_items(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"sample_id": 1, "query": "News?", "gt_answer": "Yes"}])
    [item] = load_benchmark(path, "mmsearch", name="mmsearch_news").items
    assert item.images == () and item.benchmark == "mmsearch_news" and item.key == "mmsearch_news/1"


def test_curated_world_prompts_load_through_the_osvl_format(tmp_path):
    image = rgb(seed=3)
    write_prompts(
        tmp_path / "rl" / "prompts.jsonl",
        [Prompt(id="p1", question="Which year?", images=[image], answer="1926", aliases=["MCMXXVI"])],
    )
    [item] = load_benchmark(tmp_path / "rl" / "prompts.jsonl", "osvl").items
    prompt = to_prompt(item)
    assert prompt.accepted_answers == ["1926", "MCMXXVI"] and prompt.id == "osvl/p1"
    assert np.array_equal(prompt.images[0], image)


def test_unknown_format_missing_file_and_bad_image_data_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark format 'vqav2'"):
        get_format("vqav2")
    with pytest.raises(ValueError, match="benchmark file not found"):
        load_benchmark(tmp_path / "nope.jsonl", "fvqa")
    with pytest.raises(ValueError, match="base64"):
        read_image_ref("data:image/png;base64,@@@")
    with pytest.raises(ValueError, match="cannot decode"):
        read_image_ref("data:image/png;base64," + "QUJD" * 20)
    with pytest.raises(ValueError, match="reference answer"):
        EvalItem("x", "1", "Q?", ("  ",))
    with pytest.raises(Rejected, match="not_an_object"):
        convert("text", get_format("fvqa"), tmp_path, tmp_path)


def test_livevqa_benchmark_json_array_yields_one_item_per_level(tmp_path):
    image = rgb(seed=5)
    write_png(tmp_path / "News_imgs" / "cnn_1.jpg", image)
    levels = {
        f"level{n}_qa": {
            "question": f"Q{n}?",
            "question_type": "event",
            "options": ["A. x", "B. y"],
            "Ground_Truth": "B",
            "Ground_Truth_List": [f"answer {n}", f"alias {n}"],
            "img_path": "cnn_1.jpg",
            "img_url": "https://example.com/1.jpg",
        }
        for n in (1, 2)
    }
    records = [
        {"id": "0_2025", "img_path": "cnn_1.jpg", **levels, "source": "CNN World", "time": "2024-10-02"},
        {"id": "0_bad", "source": "CNN World"},
        7,
    ]
    path = tmp_path / "benchmark.json"
    path.write_text(json.dumps(records, indent=2), encoding="utf-8")
    report = load_benchmark(path, "livevqa", tmp_path / "News_imgs")
    assert [i.id for i in report.items] == ["0_2025/level1_qa", "0_2025/level2_qa"]
    first, second = report.items
    assert first.question == "Q1?" and first.answers == ("answer 1", "alias 1") and second.answers[0] == "answer 2"
    assert first.meta == {"question_type": "event", "source": "CNN World", "time": "2024-10-02"}
    assert np.array_equal(read_image_ref(second.images[0]), image)
    assert dict(report.rejected) == {"missing_question": 1, "not_an_object": 1}
    assert report.examples[0].startswith("line 2: missing_question")


def test_infoseek_numeric_aliases_and_jsonl_opening_with_an_array_line(tmp_path):
    write_png(tmp_path / "oven_1.jpg", rgb())
    rows = [
        "[1, 2]",
        {
            "data_id": "infoseek_val_1",
            "image_id": "oven_1",
            "question": "How long?",
            "answer": ["3 km"],
            "answer_eval": ["3 km", {"wikidata": 3.0, "range": [2.7, 3.3]}],
        },
    ]
    report = load_benchmark(write_jsonl(tmp_path / "i.jsonl", rows), "infoseek")
    assert report.items[0].answers == ("3 km", "3.0") and dict(report.rejected) == {"not_an_object": 1}
    bad = write_jsonl(
        tmp_path / "j.jsonl",
        [{"data_id": "x", "image_id": "oven_1", "question": "Q?", "answer": ["a"], "answer_eval": [{"range": [1, 2]}]}],
    )
    assert dict(load_benchmark(bad, "infoseek").rejected) == {"alias_not_text": 1}


def _write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_fvqa_release_parquet_in_verl_layout(tmp_path):
    """lmms-lab/FVQA fvqa_test.parquet: chat ``prompt``, ``images`` structs, ``reward_model`` answers."""
    from tests.eval.helpers import png_bytes

    image = rgb(seed=7)
    rows = [
        {
            "data_id": "fvqa_test_0",
            "category": "object",
            "data_source": "fvqa",
            "prompt": [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "<image>\nWhat is this tool used for?"},
            ],
            "images": [{"bytes": png_bytes(image), "path": None}],
            "reward_model": {"ground_truth": "cutting", "candidate_answers": ["cutting", "to cut wood"]},
        },
        {
            "data_id": "fvqa_test_1",
            "category": "object",
            "data_source": "fvqa",
            "prompt": [{"role": "user", "content": "<image>"}],
            "images": [{"bytes": png_bytes(image), "path": None}],
            "reward_model": {"ground_truth": "x", "candidate_answers": []},
        },
    ]
    report = load_benchmark(_write_parquet(tmp_path / "fvqa_test.parquet", rows), "fvqa")
    [item] = report.items
    assert item.id == "fvqa_test_0" and item.question == "What is this tool used for?"
    assert item.answers == ("cutting", "to cut wood")
    assert item.meta == {"category": "object", "data_source": "fvqa"}
    assert np.array_equal(read_image_ref(item.images[0]), image)
    assert dict(report.rejected) == {"missing_question": 1} and report.examples[0].startswith("line 2:")
    # the same record exported to JSONL with the struct as JSON text (pandas / datasets exports)
    exported = {
        **rows[0],
        "images": [{"bytes": b64(image), "path": None}],
        "reward_model": json.dumps(rows[0]["reward_model"]),
    }
    [again] = load_benchmark(write_jsonl(tmp_path / "fvqa.jsonl", [exported]), "fvqa").items
    assert again.answers == item.answers and again.question == item.question


def test_vdr_bench_parquet_with_image_bytes(tmp_path):
    from tests.eval.helpers import png_bytes

    image = rgb(seed=8)
    path = _write_parquet(
        tmp_path / "vdr_testmini.parquet",
        [
            {"id": "vdr_12", "question": "Which museum holds it?", "answer": "Louvre", "image": png_bytes(image)},
            {"id": "vdr_13", "question": "Q?", "answer": "A", "image": b""},
        ],
    )
    report = load_benchmark(path, "vdr")
    [item] = report.items
    assert (item.id, item.answers) == ("vdr_12", ("Louvre",))
    assert np.array_equal(read_image_ref(item.images[0]), image)
    assert dict(report.rejected) == {"missing_image": 1}


def test_browsecomp_vl_release_lines_without_ids(tmp_path):
    """WebWatcher's bc_vl_level1.jsonl: ``question``, ``answers`` list, relative ``image_path``, no id."""
    image = rgb(seed=9)
    write_png(tmp_path / "images" / "level1" / "bc_0.jpg", image)
    rows = [
        {
            "question": "Which team owns the stadium?",
            "answers": ["Hearts", "Heart of Midlothian"],
            "image_path": "images/bc_0.jpg",
            "domain": "sports",
        },
        {"question": "Q2?", "answers": ["B"], "image_path": "level1/bc_0.jpg"},
        {"question": "Q3?", "answers": ["C"], "image_path": "images/missing.jpg"},
    ]
    path = write_jsonl(tmp_path / "bc_vl_level1.jsonl", rows)
    report = load_benchmark(path, "browsecomp_vl", tmp_path / "images" / "level1", name="bc_vl_level1")
    assert [i.id for i in report.items] == ["1", "2"]
    first = report.items[0]
    assert first.answers == ("Hearts", "Heart of Midlothian") and first.meta == {"domain": "sports"}
    assert np.array_equal(read_image_ref(first.images[0]), image)
    assert dict(report.rejected) == {"image_not_found": 1} and report.examples[0].startswith("line 3:")


def test_unreadable_parquet_is_a_clear_error(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(ValueError, match="cannot read parquet file"):
        load_benchmark(path, "fvqa")


def test_simplevqa_parquet_with_hf_image_structs(tmp_path):
    from tests.eval.helpers import png_bytes

    image = rgb(seed=10)
    path = _write_parquet(
        tmp_path / "simplevqa_test.parquet",
        [
            {
                "data_id": 0,
                "image": {"bytes": png_bytes(image), "path": "0.png"},
                "question": "Who painted this?",
                "answer": "Vermeer",
                "language": "EN",
                "vqa_category": "art",
                "atomic_question": "Who painted it?",
            }
        ],
    )
    [item] = load_benchmark(path, "simplevqa").items
    assert (item.id, item.answers, item.meta) == ("0", ("Vermeer",), {"language": "EN", "vqa_category": "art"})
    assert np.array_equal(read_image_ref(item.images[0]), image)
