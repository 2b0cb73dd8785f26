"""The service processes of the GRPO serving-topology tests, each started as its own process:

    python -m tests.trainer.services sglang MODEL_DIR READY_FILE   # scripted SGLang-protocol server
    python -m tests.trainer.services tools READY_FILE              # tool server with the echo/refuse tools

The SGLang-protocol server runs the loopback server over the checkpoint with the tests' scripted
policy (forced decoding: scripted ids, the served model's own logprobs); the tool server serves
the fault tools of ``tests.tools.fault_tools`` from a worker pool.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path


def _ready(path: str, url: str) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(url)
    tmp.replace(path)


def serve_sglang(model_dir: str, ready: str) -> None:
    from osvl.rollout.loopback import LoopbackServer, engine_from_checkpoint
    from tests.trainer.grpo_fixtures import script_for

    engine = engine_from_checkpoint(model_dir)
    server = LoopbackServer(engine, model_path=str(Path(model_dir).resolve()), script=script_for(engine.tokenizer))
    server.start()
    _ready(ready, server.url)
    threading.Event().wait()


def serve_tools(ready: str) -> None:
    from osvl.tools import PoolConfig, ToolPool, ToolRegistry, ToolsConfig
    from osvl.tools.server import ToolServer
    from tests.tools.fault_tools import fault_specs

    registry = ToolRegistry(fault_specs())
    with ToolPool(ToolsConfig(), PoolConfig(num_workers=1, preload=registry.targets())) as pool:
        server = ToolServer(registry, pool).start()
        _ready(ready, server.url)
        threading.Event().wait()


if __name__ == "__main__":
    kind, *args = sys.argv[1:]
    {"sglang": serve_sglang, "tools": serve_tools}[kind](*args)
