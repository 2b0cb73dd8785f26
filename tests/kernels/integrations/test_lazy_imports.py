from __future__ import annotations

import subprocess
import sys


def test_osvl_kernels_and_adapters_do_not_import_host_frameworks():
    code = (
        "import sys, osvl_kernels, osvl_kernels.integrations, osvl_kernels.integrations.verl, "
        "osvl_kernels.integrations.trl, osvl_kernels.integrations.verl_engine\n"
        "print(sorted(m for m in ('verl', 'trl', 'torchtitan', 'ray', 'tensordict') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
