"""2 gloo ranks vs one process: FSDP2 (+full AC, +CPU offload), TP=2, EP=2 give the same loss
and gradients; DCP save -> load round-trips exactly; the streamed HF write of a sharded model holds
the same tensors as a one-process write, within a per-rank memory bound, and loads in osvl and in
transformers. All scenarios share one spawn (process start dominates the cost on CPU)."""

import json

import pytest
import torch
import transformers
from safetensors import safe_open

from osvl.data.mrope import mrope_position_ids
from osvl.model import build_model, from_pretrained, hf_tensor_specs, save_pretrained
from tests.model.hf_reference import IMAGE_TOKEN, hf_logits, make_document, pixels_for
from tests.parallel.harness import run_ranks
from tests.parallel.workers import HF_WRITES, SCENARIOS, hf_write_arch, run_scenarios


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    run_ranks(run_scenarios, 2, str(out))
    return out, json.loads((out / "results.json").read_text())


def test_two_rank_scenarios_match_one_process(two_ranks):
    _, results = two_ranks
    assert results.keys() == SCENARIOS.keys() | HF_WRITES.keys()
    failed = {name: tb for name, tb in results.items() if tb != "ok"}
    assert not failed, "\n\n".join(f"[{name}]\n{tb}" for name, tb in failed.items())


def _tensors(path):
    index = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    out = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def _one_process_model(root, name):
    _, moe, layers, _ = HF_WRITES[name]
    model = build_model(hf_write_arch(moe, layers))
    model.load_state_dict(torch.load(root / name / "unsharded.pt"))
    return model


@pytest.mark.parametrize("name", list(HF_WRITES))
def test_streamed_write_holds_the_one_process_tensors(two_ranks, name, tmp_path):
    out, results = two_ranks
    assert results[name] == "ok", results[name]
    dtype = HF_WRITES[name][3]
    model = _one_process_model(out, name)
    max_shard = sum(s.nbytes for s in hf_tensor_specs(model, dtype)) // 8
    one = save_pretrained(model, tmp_path, dtype=dtype, max_shard_bytes=max_shard)
    assert {f.owner for f in one} == {0}
    two_dir = out / name / "hf"
    owners = {f: n for n, f in json.loads((two_dir / "model.safetensors.index.json").read_text())["weight_map"].items()}
    assert len(owners) > 1
    assert (two_dir / "config.json").read_text() == (tmp_path / "config.json").read_text()
    mine, theirs = _tensors(tmp_path), _tensors(two_dir)
    assert list(mine) and mine.keys() == theirs.keys()
    for key, tensor in mine.items():
        assert tensor.dtype == theirs[key].dtype == (dtype or torch.float32), key
        assert torch.equal(tensor, theirs[key]), key
    loaded = from_pretrained(two_dir, dtype=torch.float32).state_dict()
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded[key], tensor.to(dtype or torch.float32).float()), key
    peaks = [json.loads((out / name / f"peak_rank{r}.json").read_text()) for r in (0, 1)]
    assert all(0 < p["peak"] <= p["bound"] for p in peaks), peaks


@pytest.mark.parametrize("name", ["hf_write_fsdp2_dense_bf16", "hf_write_fsdp2_ep2_moe"])
def test_transformers_loads_the_streamed_write(two_ranks, name):
    """The directory the two ranks wrote is a model for transformers: same logits as osvl's load."""
    out, _ = two_ranks
    moe = HF_WRITES[name][1]
    cls = transformers.Qwen3VLMoeForConditionalGeneration if moe else transformers.Qwen3VLForConditionalGeneration
    path = out / name / "hf"
    hf_model = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ours = from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(2)
    doc = make_document(6, [(1, 4, 4)], gen)
    pixels = pixels_for(doc.grids, ours.arch.vision.patch_dim, gen)
    positions = torch.from_numpy(mrope_position_ids(doc.input_ids.numpy(), doc.grids, IMAGE_TOKEN))
    with torch.no_grad():
        got = ours(
            doc.input_ids,
            cu_seqlens=torch.tensor([0, len(doc.input_ids)], dtype=torch.int32),
            position_ids=positions,
            pixel_values=pixels,
            image_grid_thw=torch.tensor(doc.grids),
        )
    torch.testing.assert_close(got, hf_logits(hf_model, doc, pixels), rtol=1e-4, atol=1e-4)
