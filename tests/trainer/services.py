"""The service processes of the GRPO serving-topology tests, each started as its own process, with the
``--port`` / ``--ready-file`` convention of osvl's services (so ``osvl.serve.supervisor`` can restart them):

    python -m tests.trainer.services sglang MODEL_DIR [--gated] --port P --ready-file F   # scripted SGLang server
    python -m tests.trainer.services tools [--workers N] [--gate FILE] --port P --ready-file F   # echo/refuse tools

The SGLang-protocol server runs the loopback server over the checkpoint with the tests' scripted
policy (forced decoding: scripted ids, the served model's own logprobs; ``gated``: the slow prompt's
rollouts call the gate tool first); the tool server serves the fault tools of
``tests.tools.fault_tools`` from a worker pool, and with ``GATE`` (a file path) the gate tool of
``tests.trainer.gate_tool`` too.
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path


def _ready(path: str, url: str) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(url)
    tmp.replace(path)


def serve_sglang(model_dir: str, ready: str, port: int, gated: bool) -> None:
    from osvl.serve.loopback_engine import LoopbackServer, engine_from_checkpoint
    from tests.trainer.grpo_fixtures import gated_script_for, script_for

    engine = engine_from_checkpoint(model_dir)
    policy = (gated_script_for if gated else script_for)(engine.tokenizer)
    server = LoopbackServer(engine, port=port, model_path=str(Path(model_dir).resolve()), script=policy)
    server.start()
    _ready(ready, server.url)
    threading.Event().wait()


def serve_tools(ready: str, port: int, workers: int, gate: str) -> None:
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
    with ToolPool(ToolBackendsConfig(), PoolConfig(num_workers=workers, preload=registry.targets())) as pool:
        server = ToolServer(registry, pool, port=port).start()
        _ready(ready, server.url)
        threading.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tests.trainer.services")
    kinds = parser.add_subparsers(dest="kind", required=True)
    sglang = kinds.add_parser("sglang")
    sglang.add_argument("model_dir")
    sglang.add_argument("--gated", action="store_true", help="the slow prompt's rollouts call the gate tool first")
    tools = kinds.add_parser("tools")
    tools.add_argument("--workers", type=int, default=1)
    tools.add_argument("--gate", default="", help="serve the gate tool too, opened by this file")
    for kind in (sglang, tools):
        kind.add_argument("--port", type=int, default=0)
        kind.add_argument("--ready-file", required=True)
    args = parser.parse_args()
    if args.kind == "sglang":
        serve_sglang(args.model_dir, args.ready_file, args.port, args.gated)
    else:
        serve_tools(args.ready_file, args.port, args.workers, args.gate)
