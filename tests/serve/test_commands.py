"""``python -m osvl.serve``: the printed layout carries every value the trainer must agree with, and
``--engine loopback --launch`` starts the CPU form whose URLs the trainer's overrides name and keeps
it up: a killed service comes back where it was, the others untouched."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from osvl.config import load_recipe
from osvl.data.formats.processor import PREPROCESSOR_FILE
from osvl.model import save_pretrained
from osvl.serve.__main__ import main
from osvl.serve.commands import Layout, plan_commands
from osvl.tools.wire import INSTANCE_HEADER
from tests.rollout.helpers import IMAGE_CONFIG, tiny_model, tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_layout_carries_the_recipes_values():
    recipe = load_recipe("grpo_8b")
    layout = Layout(nodes=2, gpus_per_node=8, train_gpus=4, hosts=("gpu-a", "gpu-b"), router=True)
    commands = plan_commands(recipe, layout, "grpo_8b")
    servers = [c for c in commands if "sglang.launch_server" in c.argv]
    assert len(servers) == 2  # one TP-4 server on each node's 4 serving GPUs
    for server in servers:
        assert _flag(server.argv, "--model-path") == recipe.model.pretrained
        assert _flag(server.argv, "--tp-size") == "4" and _flag(server.argv, "--mem-fraction-static") == "0.85"
        assert _flag(server.argv, "--context-length") == str(4096 + 70000)
        assert dict(server.env)["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    router = next(c for c in commands if "sglang_router.launch_router" in c.argv)
    assert router.argv[router.argv.index("--worker-urls") + 1 :] == ("http://gpu-a:30000", "http://gpu-b:30000")
    tools = [c for c in commands if "osvl.tools.server" in c.argv]
    assert [c.host for c in tools] == ["gpu-a", "gpu-b"]
    trainers = [c for c in commands if c.argv[0] == "torchrun"]
    assert [_flag(c.argv, "--node_rank") for c in trainers] == ["0", "1"]
    sets = [a for c in trainers[:1] for i, a in enumerate(c.argv) if i and c.argv[i - 1] == "--set"]
    assert "job.world_size=8" in sets and 'rollout.sglang_urls=["http://gpu-a:29000"]' in sets
    assert 'rollout.sglang_update_urls=["http://gpu-a:30000", "http://gpu-b:30000"]' in sets
    assert 'tools.servers=["http://gpu-a:8100", "http://gpu-b:8100"]' in sets
    overridden = load_recipe("grpo_8b", sets)  # the trainer accepts exactly these overrides
    assert overridden.rollout.sglang_update_urls == ("http://gpu-a:30000", "http://gpu-b:30000")
    assert shlex.split(trainers[0].shell())[1:] == list(trainers[0].argv)


def test_tool_servers_get_the_recipes_sandbox():
    recipe = load_recipe(
        "grpo_8b",
        [
            "tools.python_interpreter=true",
            "tools.python_sandbox=sandbox_fusion",
            "tools.sandbox_fusion_url=http://fusion:8080",
        ],
    )
    tools = [
        c for c in plan_commands(recipe, Layout(1, 8, 4, ("n0",), False), "grpo_8b") if "osvl.tools.server" in c.argv
    ]
    assert "--python-interpreter" in tools[0].argv and _flag(tools[0].argv, "--python-sandbox") == "sandbox_fusion"
    assert _flag(tools[0].argv, "--sandbox-fusion-url") == "http://fusion:8080"


def test_bad_layouts_are_refused(capsys):
    recipe = load_recipe("grpo_8b")
    with pytest.raises(ValueError, match="multiple of rollout.server_tp 4"):
        plan_commands(recipe, Layout(1, 8, 2, ("n0",), False), "grpo_8b")
    with pytest.raises(SystemExit):
        main(["--recipe", "sft_8b"])
    assert "serving is for GRPO" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--recipe", "grpo_8b", "--launch"])
    assert "loopback" in capsys.readouterr().err


def test_loopback_launch_serves_what_the_overrides_name(tmp_path):
    model = tmp_path / "hf"
    save_pretrained(tiny_model(0), model, dtype=torch.float32)
    tokenizer().save(model / "tokenizer.json")
    (model / PREPROCESSOR_FILE).write_text(json.dumps(IMAGE_CONFIG.to_preprocessor_config()))
    world = tmp_path / "world"
    world.mkdir()
    (world / "corpus.jsonl").write_text(
        json.dumps({"id": "d0", "title": "Bridge", "text": "It opened in 1982."}) + "\n"
    )
    (world / "images.jsonl").write_text("")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'kernels'}"}
    log = tmp_path / "serve.log"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "osvl.serve",
            "--recipe",
            "tiny_grpo_services",
            "--engine",
            "loopback",
            "--launch",
            "--any-ports",
            "--set",
            f"model.pretrained={model}",
            "--set",
            f"tools.world_dir={world}",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
        start_new_session=True,
    )
    try:
        lines = []
        deadline = time.monotonic() + 300
        while not any("torchrun" in line for line in lines):
            assert process.poll() is None and time.monotonic() < deadline, lines
            lines.append(process.stdout.readline())
        sets = [s for i, s in enumerate(shlex.split(lines[-1])) if i and shlex.split(lines[-1])[i - 1] == "--set"]
        recipe = load_recipe("tiny_grpo_services", sets)
        info = httpx.get(f"{recipe.rollout.sglang_urls[0]}/get_model_info", timeout=30).json()
        assert Path(info["model_path"]) == model.resolve()
        tools = httpx.get(f"{recipe.tools.servers[0]}/v1/tools", timeout=30).json()
        assert {"text_search", "image_search"} <= {t["function"]["name"] for t in tools}
        models = httpx.get(recipe.judges.url + "/models", timeout=30)
        assert models.status_code == 200

        engine_pid = _service_pid(process.pid, "osvl.serve.loopback_engine")
        tool_pid = _service_pid(process.pid, "osvl.tools.server")
        instance = httpx.get(f"{recipe.tools.servers[0]}/v1/tools", timeout=30).headers[INSTANCE_HEADER]
        os.kill(tool_pid, signal.SIGKILL)  # an OOM or a crash in a native library looks the same
        deadline = time.monotonic() + 300
        while _instance(recipe.tools.servers[0]) in (None, instance):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert _service_pid(process.pid, "osvl.serve.loopback_engine") == engine_pid  # the others stay up
        assert httpx.get(f"{recipe.rollout.sglang_urls[0]}/get_model_info", timeout=30).status_code == 200
        assert f"tool server (pid {tool_pid}) ended with signal SIGKILL while serving; restart 1" in log.read_text()
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    assert process.returncode == 0


def _service_pid(serve_pid: int, module: str) -> int:
    """The pid of the child of ``serve_pid`` running ``python -m module``."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != serve_pid:
                continue
            if module in (stat.parent / "cmdline").read_bytes().decode(errors="replace").split("\0"):
                return int(stat.parent.name)
        except (OSError, ValueError, IndexError):
            continue
    raise AssertionError(f"no {module} under pid {serve_pid}")


def _instance(url: str) -> str | None:
    try:
        return httpx.get(f"{url}/v1/tools", timeout=5).headers.get(INSTANCE_HEADER)
    except httpx.HTTPError:
        return None
