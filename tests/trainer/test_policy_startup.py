"""The policy's start-up at scale: built on the meta device, sharded there, each rank allocating and
filling only its own shards (seeded init or the checkpoint slices it owns); checked before anything is
allocated."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.startup import startup_arch, write_checkpoint
from osvl.config import load_recipe
from osvl.data.tokenizer import load_tokenizer
from osvl.model import CheckpointError, from_pretrained, save_pretrained
from osvl.trainer import policy
from osvl.trainer.policy import build_policy, policy_arch
from tests.parallel.harness import run_ranks
from tests.trainer.fixtures import sft_overrides
from tests.trainer.startup import SYNC_BUCKET_BYTES, gathered_weights_body, host_memory_body, refused_split_body

REPO = Path(__file__).resolve().parents[2]


def _state(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _built(overrides: list[str]) -> dict[str, torch.Tensor]:
    """The policy built in this process without a process group (no plan applied)."""
    recipe = load_recipe("tiny_sft", overrides)
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    model = build_policy(recipe, policy_arch(recipe, tokenizer.vocab_size, tokenizer.special), 1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_equal_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key}"


PLANS = {  # preset -> [(world, parallel overrides)]
    "tiny": [(2, []), (4, ["parallel.tp=2"])],
    "tiny_moe": [(2, ["parallel.ep=2"]), (4, ["parallel.ep=4"])],
    "small": [(2, [])],  # tied embeddings
}


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(PLANS))
def test_seeded_init_is_the_same_model_whatever_the_world_size(preset, tmp_path):
    base = sft_overrides(tmp_path / "data", tmp_path / "run", f"model.preset={preset}", "job.seed=3")
    alone = _built(base)
    assert all(v.abs().sum() > 0 for k, v in alone.items() if "norm" not in k), "a parameter was left unset"
    one_rank = tmp_path / "world1.pt"
    run_ranks(gathered_weights_body, 1, base, str(one_rank))
    _assert_equal_states(_state(one_rank), alone, "world 1")
    for world, plan in PLANS[preset]:
        out = tmp_path / f"world{world}.pt"
        run_ranks(gathered_weights_body, world, base + plan, str(out))
        _assert_equal_states(_state(out), alone, f"world {world} {plan}")
    assert not torch.equal(_built([*base, "job.seed=4"])["lm_head.weight"], alone["lm_head.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
def test_each_rank_loads_its_slices_and_the_gathered_model_is_the_checkpoint(preset, tmp_path):
    base = sft_overrides(tmp_path / "data", tmp_path / "run", f"model.preset={preset}", "job.seed=5")
    written = tmp_path / "ckpt"
    recipe = load_recipe("tiny_sft", base)
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    model = build_policy(recipe, policy_arch(recipe, tokenizer.vocab_size, tokenizer.special), 1)
    save_pretrained(model, written, max_shard_bytes=50_000)  # several files, through the index
    expected = {k: v.detach().clone() for k, v in from_pretrained(written, dtype=torch.float32).state_dict().items()}
    _assert_equal_states({k: v.detach() for k, v in model.state_dict().items()}, expected, "round trip")
    loaded = [f"model.pretrained={written}", "job.seed=6"]  # the seed must not matter once weights load
    for world, plan in PLANS[preset]:
        out = tmp_path / f"world{world}.pt"
        run_ranks(gathered_weights_body, world, base + loaded + plan, str(out))
        _assert_equal_states(_state(out), expected, f"world {world} {plan}")


@pytest.mark.slow
@pytest.mark.parametrize("world,plan", [(2, []), (4, ["parallel.tp=2"])], ids=["fsdp2", "fsdp2_tp2"])
def test_host_memory_stays_near_the_rank_shard_and_the_plan_predicts_it(world, plan, large_checkpoint, tmp_path):
    """Each rank's host high-water mark while it builds and loads a >= 250M-parameter bf16 checkpoint
    grows by at most 1.5x its float32 shard + 256 MiB (the whole-model start-up grew by 3.5x the model),
    and the dry run's host plan is within 25% of what start-up, a DCP save, an HF export and a bucketed
    weight stream took."""
    base = sft_overrides(tmp_path / "data", tmp_path / "run")
    out = tmp_path / "memory"
    out.mkdir()
    overrides = [*base, f"model.pretrained={large_checkpoint}", *plan]
    try:
        run_ranks(host_memory_body, world, overrides, str(out))
    finally:  # the DCP save with AdamW state and the export take ~4 GB of disk: gone before the next test
        for written in ("dcp", "hf"):
            shutil.rmtree(out / written, ignore_errors=True)
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for r in records:
        assert r["total_params"] >= 250e6, r
        budget = 1.5 * r["shard_bytes"] + 256 * 2**20
        assert r["startup"] <= budget, (
            f"rank {r['rank']}: host grew by {r['startup'] / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB "
            f"(shard {r['shard_bytes'] / 2**20:.0f} MiB)"
        )
        assert r["shard_bytes"] <= 1.1 * 4 * r["total_params"] / world, r  # each rank holds its share
    recipe = load_recipe("tiny_sft", overrides)
    predicted = plan_host_memory(recipe, world)
    rank0 = records[0]
    for phase in ("startup", "save", "export", "sync"):
        expected = getattr(predicted, f"{phase}_bytes")
        assert abs(rank0[phase] / expected - 1) <= 0.25, (
            f"{phase}: measured {rank0[phase] / 2**20:.0f} MiB, planned {expected / 2**20:.0f} MiB"
        )


def plan_host_memory(recipe, world: int):
    """The dry run's host plan for the recipe on ``world`` CPU ranks (shards in host memory)."""
    from osvl.model import config_from_hf
    from osvl.parallel.plan import plan

    arch = config_from_hf(json.loads((Path(recipe.model.pretrained) / "config.json").read_text()))
    host = {"shards_on_host": True, "pretrained": True, "stored_bytes": 2, "export_bytes": 2, "sync_bytes": 4}
    report = plan(arch, world_size=world, parallel=recipe.parallel, host={**host, "bucket_bytes": SYNC_BUCKET_BYTES})
    return report.host


@pytest.fixture(scope="module")
def large_checkpoint(tmp_path_factory):
    """One ~270M-parameter bf16 checkpoint (~0.5 GB) for the module's tests, removed after the last."""
    root = tmp_path_factory.mktemp("large_ckpt")
    recipe = load_recipe("tiny_sft", sft_overrides(root / "data", root / "run"))
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    write_checkpoint(startup_arch(tokenizer.vocab_size, tokenizer.special), root / "ckpt")
    yield root / "ckpt"
    shutil.rmtree(root, ignore_errors=True)


def _bad_checkpoint(tmp_path: Path, base: list[str]) -> Path:
    recipe = load_recipe("tiny_sft", base)
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    model = build_policy(recipe, policy_arch(recipe, tokenizer.vocab_size, tokenizer.special), 1)
    path = tmp_path / "ckpt"
    save_pretrained(model, path, max_shard_bytes=50_000)
    return path


def _refuses_before_allocating(recipe, monkeypatch) -> CheckpointError:
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    arch = policy_arch(recipe, tokenizer.vocab_size, tokenizer.special)

    def allocated(*args, **kwargs):
        raise AssertionError("the model was allocated before the checkpoint was checked")

    monkeypatch.setattr(policy, "materialize", allocated)
    with pytest.raises(CheckpointError) as error:
        build_policy(recipe, arch, 1)
    return error.value


def test_a_bad_checkpoint_stops_before_anything_is_allocated(tmp_path, monkeypatch):
    base = sft_overrides(tmp_path / "data", tmp_path / "run")
    path = _bad_checkpoint(tmp_path, base)
    recipe = load_recipe("tiny_sft", [*base, f"model.pretrained={path}"])
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(index.values()))
    data = (path / files[2]).read_bytes()
    (path / files[2]).write_bytes(data[:-64])
    assert files[2] in str(_refuses_before_allocating(recipe, monkeypatch))
    (path / files[2]).unlink()
    assert f"{files[2]} is missing" in str(_refuses_before_allocating(recipe, monkeypatch))


def test_a_checkpoint_of_another_architecture_names_file_and_tensor(tmp_path, monkeypatch):
    base = sft_overrides(tmp_path / "data", tmp_path / "run")
    path = _bad_checkpoint(tmp_path, base)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["intermediate_size"] += 8  # the tensors no longer match the architecture
    (path / "config.json").write_text(json.dumps(config))
    recipe = load_recipe("tiny_sft", [*base, f"model.pretrained={path}"])
    message = str(_refuses_before_allocating(recipe, monkeypatch))
    assert "mlp.gate_proj.weight' has shape" in message and ".safetensors" in message, message


@pytest.mark.slow
def test_a_shape_the_plan_cannot_split_is_named_before_anything_is_allocated(tmp_path):
    """tp=2 over a checkpoint whose MLP width is odd: every rank stops naming the file and the tensor."""
    import dataclasses

    from osvl.model import build_model

    base = sft_overrides(tmp_path / "data", tmp_path / "run")
    recipe = load_recipe("tiny_sft", base)
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    arch = policy_arch(recipe, tokenizer.vocab_size, tokenizer.special)
    odd = dataclasses.replace(arch, text=dataclasses.replace(arch.text, intermediate_size=129))
    save_pretrained(build_model(odd, seed=0), tmp_path / "ckpt")
    expected = ["cannot split", "model.safetensors", "'model.language_model.layers.0.mlp.gate_proj.weight'", "tp=2"]
    run_ranks(refused_split_body, 2, [*base, f"model.pretrained={tmp_path / 'ckpt'}", "parallel.tp=2"], expected)


@pytest.mark.slow
def test_the_trainer_stops_with_one_line_and_writes_nothing(tmp_path):
    """``python -m osvl.train`` on 2 ranks with a truncated shard: exit 2, one error line naming the file, an
    empty run directory."""
    base = sft_overrides(tmp_path / "data", tmp_path / "run", "sft.max_steps=1")
    path = _bad_checkpoint(tmp_path, base)
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.write_bytes(victim.read_bytes()[:-64])
    sets = [x for o in [*base, f"model.pretrained={path}"] for x in ("--set", o)]
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "osvl.train"]
        + ["--recipe", "tiny_sft", *sets],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("python -m osvl.train: error:")]
    assert len(errors) == 1 and victim.name in errors[0], run.stderr[-3000:]
    # no traceback from a rank (torchrun's agent prints its own)
    assert str(REPO / "osvl") not in run.stderr, run.stderr[-3000:]
    leftovers = sorted(p.relative_to(tmp_path / "run") for p in (tmp_path / "run").rglob("*") if p.is_file())
    assert leftovers == [], leftovers
