"""Weight sync into SGLang-protocol servers (the loopback server): from disk and by broadcast over a
weights-update group, version confirmation, and the failures that must stop a step."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from osvl.data.formats.processor import PREPROCESSOR_FILE
from osvl.model import save_pretrained
from osvl.model.checkpoint import to_hf_state_dict
from osvl.rollout import EngineError, SGLangConfig, SGLangEngine
from osvl.rollout.weight_sync import DiskSync, DistributedSync
from osvl.serve.loopback_engine import LoopbackServer, engine_from_checkpoint
from tests.rollout.helpers import IMAGE_CONFIG, tiny_model, tokenizer


def _checkpoint(path, seed: int, moe: bool):
    save_pretrained(tiny_model(seed, moe=moe), path, dtype=torch.float32)
    tokenizer().save(path / "tokenizer.json")
    (path / PREPROCESSOR_FILE).write_text(json.dumps(IMAGE_CONFIG.to_preprocessor_config()))
    return path


@pytest.fixture(params=[False, True], ids=["dense", "moe"])
def served(request, tmp_path):
    """Two loopback servers over the same seed-0 checkpoint, and the policy (seed 1) to push into them."""
    moe = request.param
    directory = _checkpoint(tmp_path / "served", 0, moe)
    engines = [engine_from_checkpoint(directory), engine_from_checkpoint(directory)]
    with LoopbackServer(engines[0], model_path=str(directory)) as a, LoopbackServer(engines[1]) as b:
        yield engines, (a, b), tiny_model(1, moe=moe), tmp_path


def test_disk_and_distributed_paths_give_the_trainer_weights_and_its_version(served):
    engines, (a, b), policy, tmp_path = served
    with asyncio.Runner() as runner:
        disk = DiskSync(SGLangEngine(SGLangConfig((a.url,))), tmp_path / "weights", torch.float32, runner.run, keep=2)
        broadcast = DistributedSync(
            SGLangEngine(SGLangConfig((b.url,))),
            torch.float32,
            runner.run,
            bucket_bytes=4096,
            master_address="127.0.0.1",
        )  # many buckets
        for version in (3, 4, 5):
            stats = disk.sync(policy, version)
            assert stats.bytes > 0
            sent = broadcast.sync(policy, version)
            hf = to_hf_state_dict(policy.state_dict(), policy.arch)
            assert sent.bytes == sum(t.numel() * t.element_size() for t in hf.values())
        broadcast.close()
        versions = [
            runner.run(SGLangEngine(SGLangConfig((s.url,))).get_json(s.url, "/get_model_info"))["weight_version"]
            for s in (a, b)
        ]
    assert versions == ["5", "5"]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000004", "v000005"]  # the last 2 kept
    reference = policy.state_dict()
    for engine in engines:
        assert engine.policy_version == 5
        state = engine.model.state_dict()
        assert set(state) == set(reference)
        for name, tensor in reference.items():
            assert torch.equal(state[name], tensor), name


def test_a_refused_update_names_the_server_and_keeps_the_version(served):
    engines, (a, _), _, tmp_path = served
    other = tiny_model(2, moe=not engines[0].model.arch.text.is_moe)  # another architecture
    with asyncio.Runner() as runner:
        client = SGLangEngine(SGLangConfig((a.url,)))
        with pytest.raises(EngineError, match=f"refused by 1 of 1 server.*{a.url}.*another architecture"):
            DiskSync(client, tmp_path / "weights", torch.float32, runner.run).sync(other, 1)
        with pytest.raises(EngineError, match=f"{a.url}"):
            DistributedSync(
                client, torch.float32, runner.run, bucket_bytes=1 << 20, master_address="127.0.0.1", timeout_s=20
            ).sync(other, 1)
    assert engines[0].policy_version == 0


def test_a_server_reporting_an_old_version_fails_the_sync(served):
    _, (a, _), policy, tmp_path = served
    with asyncio.Runner() as runner:
        client = SGLangEngine(SGLangConfig((a.url,)))
        DiskSync(client, tmp_path / "weights", torch.float32, runner.run).sync(policy, 1)
        a.weight_version = "0"  # e.g. a server restarted from the base checkpoint behind the trainer's back
        with pytest.raises(EngineError, match=f"skew after the update to 1: {a.url} reports '0'"):
            runner.run(client.confirm_version(1))


def test_an_unreachable_server_is_an_engine_error_naming_it(tmp_path):
    policy = tiny_model(1)
    url = "http://127.0.0.1:9"
    with asyncio.Runner() as runner:
        client = SGLangEngine(SGLangConfig((url,), timeout_s=5), httpx.AsyncClient(timeout=5))
        with pytest.raises(EngineError, match=url):
            DiskSync(client, tmp_path / "weights", torch.float32, runner.run).sync(policy, 1)
        with pytest.raises(EngineError, match=url):
            DistributedSync(client, torch.float32, runner.run, bucket_bytes=1 << 20, master_address="127.0.0.1").sync(
                policy, 1
            )


def test_with_pause_every_bucket_lands_while_generation_is_paused(served, monkeypatch):
    """Asynchronous GRPO: the servers generate while the trainer trains, so an update (many buckets)
    runs between /pause_generation and /continue_generation, and generation goes on after it."""
    engines, (a, b), policy, tmp_path = served
    events = []
    for server, name in ((a, "a"), (b, "b")):
        for method in ("pause", "resume", "update_from_disk", "_load_hf"):
            real = getattr(server, method)
            monkeypatch.setattr(
                server,
                method,
                lambda *args, _real=real, _tag=f"{name}.{method}": (events.append(_tag), _real(*args))[1],
            )
    with asyncio.Runner() as runner:
        disk = DiskSync(
            SGLangEngine(SGLangConfig((a.url,))), tmp_path / "weights", torch.float32, runner.run, pause=True
        )
        broadcast = DistributedSync(
            SGLangEngine(SGLangConfig((b.url,))),
            torch.float32,
            runner.run,
            bucket_bytes=4096,
            master_address="127.0.0.1",
            pause=True,
        )
        disk.sync(policy, 1)
        broadcast.sync(policy, 1)
        broadcast.close()
        request = {
            "input_ids": tokenizer().encode("Which bridge?"),
            "sampling_params": {"max_new_tokens": 2},
            "return_logprob": True,
        }
        for server in (a, b):  # the gate is open again
            answer = httpx.post(f"{server.url}/generate", json=request, timeout=60, trust_env=False).json()
            assert answer["meta_info"]["weight_version"] == "1"
    assert [e for e in events if e.startswith("a.")] == ["a.pause", "a.update_from_disk", "a.resume"]
    on_b = [e for e in events if e.startswith("b.")]
    assert on_b[0] == "b.pause" and on_b[-1] == "b.resume" and on_b.count("b._load_hf") > 2
    assert set(on_b[1:-1]) == {"b._load_hf"}
