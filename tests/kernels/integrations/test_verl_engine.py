"""osvl's fused-lm_head engine against verl 0.9.1's own FSDP2 engine: one actor update of a tiny Qwen2 on CPU
(verl_engine_case.py, a process of its own), same loss per micro-batch, same gradient on every parameter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from osvl_kernels.integrations.verl_engine import fused_engine_class, register_fused_engine

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow  # a real verl engine, twice, in a process of its own


@pytest.fixture(scope="module")
def updates(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("verl_engine") / "updates.pt"
    run = [sys.executable, "-m", "tests.kernels.integrations.verl_engine_case", str(out)]
    proc = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def test_fused_engine_update_equals_verls_engine(updates):
    verl, osvl = updates["verl"], updates["osvl"]
    assert len(verl["losses"]) == len(osvl["losses"]) == 2  # two micro-batches, gradients accumulated
    torch.testing.assert_close(torch.tensor(osvl["losses"]), torch.tensor(verl["losses"]), rtol=1e-5, atol=1e-6)
    assert verl["grads"].keys() == osvl["grads"].keys() and "lm_head.weight" in verl["grads"]
    for name, grad in verl["grads"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(osvl["grads"][name], grad, rtol=1e-4, atol=1e-8, msg=name)
    for name in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert osvl["metrics"][name] == pytest.approx(verl["metrics"][name], rel=1e-5, abs=1e-7), name


def test_fused_engine_refuses_a_loss_mode_it_does_not_compute(updates):
    assert "actor.policy_loss.loss_mode='gspo'" in updates["refused"]


def test_register_swaps_the_fsdp_language_model_engines(monkeypatch):
    from verl.workers.engine.base import EngineRegistry

    table = {kind: {backend: dict(keys) for backend, keys in v.items()} for kind, v in EngineRegistry._engines.items()}
    monkeypatch.setattr(EngineRegistry, "_engines", table)
    before = dict(table["language_model"]["fsdp2"])
    registered = register_fused_engine()
    assert registered == register_fused_engine()  # idempotent
    for key, cls in table["language_model"]["fsdp2"].items():
        assert cls.osvl_fused and issubclass(cls, before[key]) and cls is fused_engine_class(before[key])
    assert not any(getattr(cls, "osvl_fused", False) for cls in table["value_model"]["fsdp2"].values())
