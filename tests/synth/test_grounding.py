"""Anchor grounding and the degradation subset."""

from __future__ import annotations

import random
from pathlib import Path

import cv2
import pytest

from osvl.synth.grounding import (
    REPAIR_TOOL,
    AnchorGrounder,
    MetadataScorer,
    degrade,
    in_degradation_subset,
)
from osvl.synth.question import Mention, Rel
from osvl.synth.records import Drop, QAItem
from osvl.synth.rewrite import canonical_question
from osvl.synth.sampling import SampledPath
from osvl.tools.image_tools import perspective_correct, sharpen
from osvl.world.build import ImageRecord
from osvl.world.render import render_entity

from .graphs import australia_zoo_graph
from .test_rewrite import TOOK_OVER_1991

PATH = SampledPath(
    ("Australia_Zoo", "Steve_Irwin", "Terri_Irwin"), ("manager", "spouse"), "citizenship date", "17 November 2009"
)


def _item(graph, rewritten: bool = True) -> QAItem:
    question = canonical_question(graph, PATH)
    if rewritten:
        question = question.with_mention(1, TOOK_OVER_1991).with_mention(
            2, Mention(noun="person", constraints=(Rel("spouse", 1),))
        )
    return QAItem("AZ", list(PATH.nodes), list(PATH.relations), PATH.attribute, PATH.answer, question)


def _record(root: Path, caption: str, width: int = 800) -> ImageRecord:
    return ImageRecord(
        image=root / "images" / "Australia_Zoo.png",
        title="Australia Zoo",
        caption=caption,
        page_id="Australia_Zoo",
        width=width,
        height=600,
        facts=[],
    )


def test_grounding_replaces_the_anchor_with_a_visual_reference(tmp_path):
    graph = australia_zoo_graph()
    grounder = AnchorGrounder(
        graph, {"Australia_Zoo": [_record(tmp_path, "Australia Zoo entrance")]}, tmp_path, MetadataScorer()
    )
    grounded = grounder(_item(graph))
    assert grounded.question.mentions[0].visual and grounded.image == "images/Australia_Zoo.png"
    assert "the zoo shown in the image" in grounded.text and grounded.grounding_score == 1.0


def test_grounding_drops_what_it_cannot_ground(tmp_path):
    graph = australia_zoo_graph()
    item = _item(graph)
    assert AnchorGrounder(graph, {}, tmp_path, MetadataScorer())(item) == Drop("no_anchor_image")
    small = {"Australia_Zoo": [_record(tmp_path, "", width=300)]}
    assert AnchorGrounder(graph, small, tmp_path, MetadataScorer())(item) == Drop("no_anchor_image")

    class Unrelated:
        def score(self, image, description):
            return 0.1

    images = {"Australia_Zoo": [_record(tmp_path, "x")]}
    assert AnchorGrounder(graph, images, tmp_path, Unrelated())(item) == Drop("low_visual_relevance")
    # bridges still named: the final masking check over the whole path refuses the item
    named = _item(graph, rewritten=False)
    assert AnchorGrounder(graph, {"Australia_Zoo": [_record(tmp_path, "Australia Zoo")]}, tmp_path, MetadataScorer())(
        named
    ) == Drop("masking_leak")


def test_metadata_scorer():
    record = ImageRecord(Path("x.png"), "Varnel Tower", "Varnel Tower, a lighthouse", "V", 512, 512, [])
    assert MetadataScorer().score(record, "Varnel Tower lighthouse") == 1.0
    assert MetadataScorer().score(record, "Orvel Bridge") == 0.0


@pytest.fixture(scope="module")
def picture():
    return render_entity("Varnel Tower", "Building/Place", 256, 5)


def _sharpness(image):
    return cv2.Laplacian(cv2.cvtColor(image, cv2.COLOR_RGB2GRAY), cv2.CV_64F).var()


def test_each_degradation_is_repaired_by_its_tool(picture):
    rng = random.Random(0)
    blurred = degrade(picture, "blur", rng)
    assert _sharpness(blurred) < 0.1 * _sharpness(picture)
    assert _sharpness(sharpen(blurred, 1.5, 2.0)) > 1.5 * _sharpness(blurred)
    assert degrade(picture, "downsample", rng).shape == (64, 64, 3)
    warped = degrade(picture, "perspective", rng)
    assert warped.shape[0] > picture.shape[0]
    rectified = perspective_correct(warped)
    assert rectified.corners is not None
    assert abs(rectified.image.shape[0] - picture.shape[0]) < 0.15 * picture.shape[0]
    assert set(REPAIR_TOOL.values()) == {"sharpen", "super_resolution", "perspective_correct"}
    with pytest.raises(ValueError, match="unknown degradation"):
        degrade(picture, "fog", rng)


def test_degradation_subset_is_stable_and_about_ten_percent():
    chosen = [in_degradation_subset(f"item{i}", 0.1, 0) for i in range(4000)]
    assert abs(sum(chosen) / 4000 - 0.1) < 0.02
    assert chosen == [in_degradation_subset(f"item{i}", 0.1, 0) for i in range(4000)]
    assert not any(in_degradation_subset(f"item{i}", 0.0, 0) for i in range(100))
    with pytest.raises(ValueError, match="fraction"):
        in_degradation_subset("x", 1.5, 0)
