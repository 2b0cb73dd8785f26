"""The service processes of the GRPO serving-topology tests, each started as its own process:

    python -m tests.trainer.services sglang MODEL_DIR READY_FILE [gated]        # scripted SGLang-protocol server
    python -m tests.trainer.services tools READY_FILE [PORT [WORKERS [GATE]]]   # tool server, echo/refuse tools

The SGLang-protocol server runs the loopback server over the checkpoint with the tests' scripted
policy (forced decoding: scripted ids, the served model's own logprobs; ``gated``: the slow prompt's
rollouts call the gate tool first); the tool server serves the fault tools of
``tests.tools.fault_tools`` from a worker pool, and with ``GATE`` (a file path) the gate tool of
``tests.trainer.gate_tool`` too.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path


def _ready(path: str, url: str) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(url)
    tmp.replace(path)


def serve_sglang(model_dir: str, ready: str, script: str = "plain") -> None:
    from osvl.rollout.loopback import LoopbackServer, engine_from_checkpoint
    from tests.trainer.grpo_fixtures import gated_script_for, script_for

    engine = engine_from_checkpoint(model_dir)
    policy = {"plain": script_for, "gated": gated_script_for}[script](engine.tokenizer)
    server = LoopbackServer(engine, model_path=str(Path(model_dir).resolve()), script=policy)
    server.start()
    _ready(ready, server.url)
    threading.Event().wait()


def serve_tools(ready: str, port: str = "0", workers: str = "1", gate: str = "") -> None:
    import os

    from osvl.tools import PoolConfig, ToolBackendsConfig, ToolPool, ToolRegistry
    from osvl.tools.server import ToolServer
    from tests.tools.fault_tools import fault_specs
    from tests.trainer.gate_tool import GATE_ENV, gate_spec

    specs = fault_specs()
    if gate:
        os.environ[GATE_ENV] = gate  # the pool's workers inherit it
        specs.append(gate_spec())
    registry = ToolRegistry(specs)
    with ToolPool(ToolBackendsConfig(), PoolConfig(num_workers=int(workers), preload=registry.targets())) as pool:
        server = ToolServer(registry, pool, port=int(port)).start()
        _ready(ready, server.url)
        threading.Event().wait()


if __name__ == "__main__":
    kind, *args = sys.argv[1:]
    {"sglang": serve_sglang, "tools": serve_tools}[kind](*args)
