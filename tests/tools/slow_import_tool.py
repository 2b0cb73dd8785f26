"""A tool whose module takes longer to import than its calls may run: a worker must import it
before it reports ready, or the first call times out."""

from __future__ import annotations

import time

from osvl.tools.registry import ToolOutput

IMPORT_SECONDS = 2.0  # over the 1 s call deadline the preload tests use
time.sleep(IMPORT_SECONDS)


def answer(arguments, images, config):
    return ToolOutput(text="imported slowly")
