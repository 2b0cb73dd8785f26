import json
import shutil

import cv2
import numpy as np
import pytest

from osvl.rl.trajectory import ToolStatus
from osvl.tools import BackendError, ImageSearchConfig, TextSearchConfig, ToolBackendsConfig, image_search
from osvl.tools.image_io import decode_image, encode_png, image_size
from osvl.tools.image_search import NearDuplicateIndex
from osvl.tools.text_search import build_text_index, extractive_summary, offline_search
from osvl.tools.worker import run_job
from tests.tools.images import blur, scene

CORPUS = [
    {
        "id": "kessock",
        "title": "Kessock Bridge",
        "url": "https://en.wikipedia.org/wiki/Kessock_Bridge",
        "text": "The Kessock Bridge is a cable-stayed bridge in Scotland. It carries the A9 over the Beauly Firth. "
        "The bridge opened in 1982 after four years of construction. It was designed by a German firm.",
    },
    {
        "id": "forth",
        "title": "Forth Bridge",
        "text": "The Forth Bridge is a cantilever railway bridge across the Firth of Forth. It opened in 1890.",
    },
    {
        "id": "irwin",
        "title": "Terri Irwin",
        "text": "Terri Irwin is a naturalist. She became an Australian citizen in 2009. She runs Australia Zoo.",
    },
]


@pytest.fixture()
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in CORPUS) + "\n", encoding="utf-8")
    return path


def test_bm25_finds_the_right_page_and_summarises_it(corpus, tmp_path):
    config = TextSearchConfig(corpus_path=str(corpus), index_path=str(tmp_path / "idx.sqlite"))
    passages = offline_search("When did the Kessock Bridge open?", 2, config)
    assert passages[0].title == "Kessock Bridge"
    assert passages[0].url == "https://en.wikipedia.org/wiki/Kessock_Bridge"
    assert "opened in 1982" in passages[0].summary
    assert len(passages) == 2 and passages[1].title == "Forth Bridge"
    assert offline_search("Australian citizen", 5, config)[0].url == "corpus://irwin"


def test_text_search_tool_output_shape_and_no_results(corpus, tmp_path):
    config = ToolBackendsConfig(text_search=TextSearchConfig(corpus_path=str(corpus)))
    status, text, _, error = run_job(
        "osvl.tools.text_search:text_search_tool",
        {"query": 'Forth "railway" (bridge) OR NEAR*', "top_k": 1},
        [],
        config,
    )
    assert status is ToolStatus.OK, error  # FTS5 syntax in a query is searched as words, not executed
    assert text.startswith("[Passage 1] Forth Bridge\nURL: corpus://forth\nSummary: ")
    status, _, _, error = run_job(
        "osvl.tools.text_search:text_search_tool", {"query": "zebra quantum", "top_k": 3}, [], config
    )
    assert status is ToolStatus.TOOL_ERROR and "no results" in error
    status, _, _, error = run_job("osvl.tools.text_search:text_search_tool", {"query": "?!", "top_k": 3}, [], config)
    assert status is ToolStatus.TOOL_ERROR and "no searchable words" in error


def test_index_is_rebuilt_when_the_corpus_changes(corpus, tmp_path):
    index = tmp_path / "idx.sqlite"
    build_text_index(corpus, index)
    config = TextSearchConfig(corpus_path=str(corpus), index_path=str(index))
    assert offline_search("zebra", 1, config) == []
    with open(corpus, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"id": "z", "title": "Zebra", "text": "A zebra is striped."}) + "\n")
    assert offline_search("zebra", 1, config)[0].title == "Zebra"


def test_bad_corpus_lines_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "title": "A", "text": "x"}\n{"id": "b", "title": 3, "text": "y"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: missing or non-string field"):
        build_text_index(path, tmp_path / "i.sqlite")
    path.write_text("not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not JSON"):
        build_text_index(path, tmp_path / "i.sqlite")
    with pytest.raises(BackendError, match="does not exist"):
        offline_search("x", 1, TextSearchConfig(corpus_path=str(tmp_path / "missing.jsonl")))
    with pytest.raises(BackendError, match="needs TextSearchConfig.corpus_path"):
        offline_search("x", 1, TextSearchConfig())


def test_extractive_summary_keeps_page_order():
    text = "Alpha one. Beta bridge two. Gamma three. Delta bridge opened four."
    assert (
        extractive_summary(text, ["bridge", "opened"], max_sentences=2) == "Beta bridge two. Delta bridge opened four."
    )
    assert extractive_summary(text, ["bridge", "opened"], max_sentences=1) == "Delta bridge opened four."
    assert extractive_summary("", ["x"]) == ""


def test_extractive_summary_shows_what_the_query_asks_of_the_page():
    """Every sentence of a person's page names them: the sentence with the asked attribute must win
    over sentences that only repeat the title's words (the demo's lookups failed on exactly this)."""
    text = (
        "Jorlo Talcor is a person. The birthplace of Jorlo Talcor is Dandramar. Its occupation is engineer. "
        "The citizenship of Jorlo Talcor is Dracorland. The spouse of Jorlo Talcor is Osar Bel."
    )
    terms = ["jorlo", "talcor", "occupation"]
    assert extractive_summary(text, terms, title="Jorlo Talcor") == "Its occupation is engineer."
    # without the page title every query word counts alike, and the title's sentences crowd it out
    assert "occupation" not in extractive_summary(text, terms, max_sentences=3)
    # a query of the title alone asks nothing in particular: the sentences richest in its words, first first
    assert extractive_summary(text, ["jorlo", "talcor", "birthplace"], title="Jorlo Talcor birthplace") == (
        "Jorlo Talcor is a person. The birthplace of Jorlo Talcor is Dandramar. The citizenship of Jorlo Talcor is "
        "Dracorland."
    )
    many = " ".join(f"Town{i} is a landmark of Quenel." for i in range(9))
    assert extractive_summary(many, ["quenel", "landmark"], title="Quenel").count("landmark") == 6  # max_sentences


@pytest.fixture(scope="module")
def collection(tmp_path_factory):
    folder = tmp_path_factory.mktemp("collection")
    lines = []
    for seed in range(6):
        image = scene(100 + seed, (320, 400))
        (folder / f"img{seed}.png").write_bytes(encode_png(image))
        lines.append(
            json.dumps(
                {
                    "image": f"img{seed}.png",
                    "title": f"Entity {seed}",
                    "caption": f"caption {seed}",
                    "page_id": f"page-{seed}",
                }
            )
        )
    path = folder / "collection.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    "degrade, kind",
    [
        (lambda im: cv2.resize(im, (200, 160), interpolation=cv2.INTER_AREA), "near_duplicate"),
        (lambda im: blur(im, 2.0), "near_duplicate"),
        (lambda im: cv2.resize(im[60:300, 80:360], (420, 360)), "feature_match"),
    ],
)
def test_image_search_finds_originals_after_degradation(collection, degrade, kind):
    config = ToolBackendsConfig(image_search=ImageSearchConfig(collection_path=str(collection)))
    original = scene(103, (320, 400))
    status, text, _, error = run_job(
        "osvl.tools.image_search:image_search_tool", {"image": 0, "top_k": 3}, [degrade(original)], config
    )
    assert status is ToolStatus.OK, error
    assert text.startswith("[Match 1] Entity 3 (page: page-3; " + kind)
    assert "Caption: caption 3" in text


def test_image_search_with_nothing_similar_is_a_tool_error(collection):
    index = NearDuplicateIndex.from_jsonl(collection, 10**7)
    assert len(index.entries) == 6
    noise = np.random.default_rng(0).integers(0, 255, (200, 200, 3), dtype=np.uint8)
    assert index.search(noise, 3) == []
    config = ToolBackendsConfig(image_search=ImageSearchConfig(collection_path=str(collection)))
    status, _, _, error = run_job(
        "osvl.tools.image_search:image_search_tool", {"image": 0, "top_k": 3}, [noise], config
    )
    assert status is ToolStatus.TOOL_ERROR and "no visual matches" in error


def _copy_collection(source, folder):
    folder.mkdir()
    for file in source.parent.glob("img*.png"):
        shutil.copy(file, folder / file.name)
    shutil.copy(source, folder / source.name)
    return folder / source.name


def _same_index(a: NearDuplicateIndex, b: NearDuplicateIndex) -> None:
    assert len(a.entries) == len(b.entries)
    for x, y in zip(a.entries, b.entries):
        assert (x.title, x.caption, x.page_id) == (y.title, y.caption, y.page_id)
        np.testing.assert_array_equal(x.phash, y.phash)
        np.testing.assert_array_equal(x.keypoints, y.keypoints)
        np.testing.assert_array_equal(x.histogram, y.histogram)
        assert (x.descriptors is None) == (y.descriptors is None)
        if x.descriptors is not None:
            np.testing.assert_array_equal(x.descriptors, y.descriptors)


def test_image_features_are_cached_beside_the_collection_and_rebuilt_when_it_changes(collection, tmp_path, monkeypatch):
    path = _copy_collection(collection, tmp_path / "world")
    built = NearDuplicateIndex.from_jsonl(path, 10**7)
    cache = path.with_name(path.name + ".features.npz")
    assert cache.is_file()
    computed = []
    real_describe = image_search.describe
    monkeypatch.setattr(image_search, "describe", lambda *a, **k: computed.append(1) or real_describe(*a, **k))
    _same_index(NearDuplicateIndex.from_jsonl(path, 10**7), built)
    assert computed == []  # read from the cache
    assert NearDuplicateIndex.from_jsonl(path, 10**7).search(scene(102, (320, 400)), 1)[0].title == "Entity 2"
    computed.clear()  # the query's own description
    NearDuplicateIndex.from_jsonl(path, 10**6)  # another pixel limit: other features
    assert len(computed) == 6
    (path.parent / "img3.png").write_bytes(encode_png(scene(999, (320, 400))))  # an image changed on disk
    changed = NearDuplicateIndex.from_jsonl(path, 10**7)
    assert len(computed) == 12
    assert changed.search(scene(999, (320, 400)), 1)[0].title == "Entity 3"
    computed.clear()
    cache.write_bytes(b"not a zip")  # a corrupt cache is rebuilt, not trusted
    _same_index(NearDuplicateIndex.from_jsonl(path, 10**7), changed)
    assert len(computed) == 6
    computed.clear()
    NearDuplicateIndex.from_jsonl(path, 10**7)
    assert computed == []  # and rewritten


def test_an_unwritable_feature_cache_is_skipped(collection, tmp_path, monkeypatch):
    path = _copy_collection(collection, tmp_path / "world")

    def refuse(*args, **kwargs):
        raise PermissionError("read-only")

    monkeypatch.setattr(image_search.tempfile, "NamedTemporaryFile", refuse)
    index = NearDuplicateIndex.from_jsonl(path, 10**7)
    assert len(index.entries) == 6 and not list(path.parent.glob("*.npz*"))


def test_bad_collections(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"image": "missing.png", "title": "x"}\n')
    with pytest.raises(ValueError, match="c.jsonl:1"):
        NearDuplicateIndex.from_jsonl(path, 10**7)
    path.write_text('{"title": "x"}\n')
    with pytest.raises(ValueError, match="needs string fields"):
        NearDuplicateIndex.from_jsonl(path, 10**7)
    config = ToolBackendsConfig(image_search=ImageSearchConfig(collection_path=str(tmp_path / "none.jsonl")))
    status, _, _, error = run_job(
        "osvl.tools.image_search:image_search_tool", {"image": 0, "top_k": 1}, [scene(1)], config
    )
    assert status is ToolStatus.INFRA_ERROR and "does not exist" in error


def test_decode_image_refuses_decompression_bombs():
    bomb = encode_png(np.zeros((3000, 3000, 3), np.uint8))  # ~30 KiB of PNG, 9 Mpx of pixels
    assert len(bomb) < 200_000 and image_size(bomb) == (3000, 3000)
    with pytest.raises(ValueError, match="over the limit of 1000000"):
        decode_image(bomb, 1_000_000)
    small = scene(2, (20, 30))
    assert np.array_equal(decode_image(encode_png(small), 1_000_000), small)
    with pytest.raises(ValueError, match="not a readable image"):
        decode_image(b"GIF89a-garbage", 1_000_000)


def test_split_sentences_keeps_order_and_drops_blanks():
    from osvl.tools.text_search import split_sentences

    assert split_sentences("  Oslo is a city. Is it old?  Yes!\n\nIts population is 709000.  ") == [
        "Oslo is a city.",
        "Is it old?",
        "Yes!",
        "Its population is 709000.",
    ]
    assert split_sentences("no stop at the end") == ["no stop at the end"]
    assert split_sentences("   ") == []


def test_an_empty_collection_indexes_nothing_and_writes_no_cache(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    assert NearDuplicateIndex.from_jsonl(path, 10**7).entries == []
    assert not list(tmp_path.glob("*.npz*"))
