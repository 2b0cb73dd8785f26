"""The demo's world, pixel for pixel: its images, pages and passages are what every drill, checkpoint and number of
``make demo`` is made from, so a library release that draws text with other pixels (OpenCV 5.1.0 did) changes the
demo's results without any change here. These digests fail first, and name the versions that drew them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import cv2
import numpy as np

from osvl.world import WorldConfig, build_world, load_world

# `python -m osvl.world build --seed 0 --scale 3`, as `make demo` builds it (with requirements/constraints.txt)
SEED, SCALE = 0, 3
IMAGES, PIXELS_SHA256 = 720, "7c234940ac36e8b07583f25f9a4ba519728d4ba61fc4defbbc97ae82fc0956a6"
FILES_SHA256 = {
    "corpus.jsonl": "7ffb7a1fe4ec468a07536c83d9b132249ad13dee078d63494a517df073da51d4",
    "graph.jsonl": "503c2e6ea1a369817fad54f40eee3a3cd854363d5512fe8a91cc0bfe5afcb2e0",
    "images.jsonl": "c01d85059a1bf8b1bb581c930443a507090fe738f89bc840634bd678d14d30f5",
}


def pixels_digest(root: Path) -> tuple[int, str]:
    """(images, sha256 over every entity's decoded RGB image in page order): PNG's compressed bytes may differ
    with zlib while the pixels do not."""
    world = load_world(root)
    digest = hashlib.sha256()
    pages = sorted(p.id for p in world.graph.entities() if p.images)
    for page in pages:
        image = world.load_image(page)
        digest.update(f"{page}:{image.shape}".encode())
        digest.update(np.ascontiguousarray(image).tobytes())
    return len(pages), digest.hexdigest()


def test_the_demo_world_is_drawn_with_the_pixels_its_results_were_measured_on(tmp_path):
    build_world(tmp_path, WorldConfig(seed=SEED).scaled(SCALE))
    versions = f"opencv {cv2.__version__}, numpy {np.__version__}"
    files = {name: hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() for name in FILES_SHA256}
    assert files == FILES_SHA256, f"the demo world's pages or passages changed ({versions})"
    assert pixels_digest(tmp_path) == (IMAGES, PIXELS_SHA256), (
        f"the demo world's images changed ({versions}): every drill and number of make demo moves with them; "
        "install the versions of requirements/constraints.txt, or re-measure the demo and update these digests"
    )
