"""Tests run Triton kernels on CPU through the interpreter; it must be set before triton loads."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
