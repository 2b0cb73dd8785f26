import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from osvl.model import (
    CheckpointError,
    HFTensorSpec,
    build_model,
    config_from_hf,
    config_to_hf,
    from_hf_state_dict,
    from_pretrained,
    hf_tensor_specs,
    iter_hf_tensors,
    save_pretrained,
    shard_plan,
    stored_tensors,
    to_hf_state_dict,
)
from tests.model.tiny import tiny_config


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_save_load_round_trip_is_exact(moe, tmp_path):
    torch.manual_seed(0)
    model = build_model(tiny_config(moe))
    save_pretrained(model, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = from_pretrained(tmp_path, dtype=torch.float32)
    assert loaded.arch == model.arch
    _assert_same_state(model, loaded)


def test_tied_embeddings_round_trip(tmp_path):
    torch.manual_seed(0)
    model = build_model(tiny_config(tie=True))
    save_pretrained(model, tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    loaded = from_pretrained(tmp_path, dtype=torch.float32)
    assert loaded.lm_head.weight is loaded.tok_embeddings.weight
    _assert_same_state(model, loaded)


def test_hf_layouts_of_patch_embed_and_experts():
    config = tiny_config(moe=True)
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in build_model(config).state_dict().items()}
    hf = to_hf_state_dict(state, config)
    E, D, F = 4, 32, 12
    assert hf["model.visual.patch_embed.proj.weight"].shape == (16, 3, 2, 2, 2)
    gate_up = hf["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (E, D, 2 * F)  # released Qwen layout
    w1 = state["layers.0.moe.routed_experts.inner_experts.w1_EFD"]
    torch.testing.assert_close(gate_up[2, :, :F], w1[2].T)
    # transformers>=5 layout [E, 2F, D] / [E, D, F] loads to the same tensors
    hf_v5 = dict(hf)
    for layer in (0, 1):
        p = f"model.language_model.layers.{layer}.mlp.experts."
        hf_v5[p + "gate_up_proj"] = hf[p + "gate_up_proj"].transpose(1, 2)
        hf_v5[p + "down_proj"] = hf[p + "down_proj"].transpose(1, 2)
    for back in (from_hf_state_dict(hf, config), from_hf_state_dict(hf_v5, config)):
        assert back.keys() == state.keys()
        for k in state:
            assert torch.equal(back[k], state[k]), k


def test_bad_checkpoints_name_the_file_and_tensor(tmp_path):
    config = tiny_config(moe=True)
    model = build_model(config, seed=0)
    save_pretrained(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    key = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    good = tensors[key]
    tensors[key] = good[:, :, :5].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"model.safetensors: '.*layers.0.mlp.experts.gate_up_proj' has shape \(4, 32, 5\)"
    ):
        from_pretrained(tmp_path)
    del tensors[key]
    tensors["model.language_model.layers.0.mlp.mystery.weight"] = torch.zeros(1)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as error:
        from_pretrained(tmp_path)
    assert f"missing '{key}'" in str(error.value)
    assert "model.safetensors: unexpected tensor 'model.language_model.layers.0.mlp.mystery.weight'" in str(error.value)
    with pytest.raises(CheckpointError, match="no config.json"):
        from_pretrained(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="max_shard_bytes"):
        save_pretrained(model, tmp_path / "x", max_shard_bytes=0)


def test_missing_or_truncated_shard_files_are_named(tmp_path):
    model = build_model(tiny_config(), seed=0)
    save_pretrained(model, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    victim = sorted(set(index.values()))[1]
    data = (tmp_path / victim).read_bytes()
    (tmp_path / victim).write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=f"{victim} cannot be read .*truncated"):
        stored_tensors(tmp_path)
    (tmp_path / victim).unlink()
    held = next(name for name, file in index.items() if file == victim)
    with pytest.raises(CheckpointError, match=f"{victim} is missing; the index places .* e.g. '{held}'"):
        stored_tensors(tmp_path)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_box_reads_exactly_that_part_of_the_parameter(moe, tmp_path):
    """Every parameter's boxes (rows, columns, expert ranges, in both expert layouts) equal the same
    slices of the whole loaded tensor."""
    from safetensors import safe_open

    from osvl.model.checkpoint import checkpoint_sources, read_box
    from osvl.model.init import init_rules

    config = tiny_config(moe=moe)
    model = build_model(config, seed=1)
    save_pretrained(model, tmp_path)
    sources = checkpoint_sources(model, stored_tensors(tmp_path))
    for layout in ("released", "v5"):
        if layout == "v5":  # transformers >= 5 stores the experts transposed
            tensors = load_file(tmp_path / "model.safetensors")
            for name in [k for k in tensors if ".mlp.experts." in k]:
                tensors[name] = tensors[name].transpose(1, 2).contiguous()
            save_file(tensors, tmp_path / "model.safetensors")
        with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
            for name, (_, param) in init_rules(model).items():
                source, found = sources[name]
                shape = tuple(param.shape)
                offset = tuple(n // 3 for n in shape)
                size = tuple(max(1, n // 2) for n in shape)
                box = read_box(f.get_slice(found.name), source, shape, offset, size)
                expected = param.detach()[tuple(slice(o, o + n) for o, n in zip(offset, size))]
                assert torch.equal(box, expected), (layout, name)


def test_config_json_round_trip_and_errors():
    for moe in (False, True):
        config = tiny_config(moe)
        raw = config_to_hf(config)
        assert raw["model_type"] == ("qwen3_vl_moe" if moe else "qwen3_vl")
        assert config_from_hf(raw) == config
    raw = config_to_hf(tiny_config())
    with pytest.raises(ValueError, match="model_type"):
        config_from_hf(dict(raw, model_type="llama"))
    bad_rope = json.loads(json.dumps(raw))
    bad_rope["text_config"]["rope_parameters"]["mrope_interleaved"] = False
    with pytest.raises(ValueError, match="interleaved"):
        config_from_hf(bad_rope)
    bad_heads = json.loads(json.dumps(raw))
    bad_heads["text_config"]["num_key_value_heads"] = 3
    with pytest.raises(ValueError, match="not divisible"):
        config_from_hf(bad_heads)
    legacy = json.loads(json.dumps(raw))  # transformers 4.x spelling: rope_scaling + top-level rope_theta
    legacy["text_config"]["rope_scaling"] = legacy["text_config"].pop("rope_parameters")
    legacy["text_config"]["rope_theta"] = legacy["text_config"]["rope_scaling"].pop("rope_theta")
    assert config_from_hf(legacy) == tiny_config()


def _specs(sizes):
    return [HFTensorSpec(f"t{i}", (n,), torch.float32) for i, n in enumerate(sizes)]


def test_shard_plan_balances_consecutive_runs_by_bytes():
    plan = shard_plan(_specs([10, 10, 10, 10, 10, 10]), world_size=2, max_shard_bytes=10**6)
    assert [(f.name, f.owner, f.tensors) for f in plan] == [
        ("model-00001-of-00002.safetensors", 0, ("t0", "t1", "t2")),
        ("model-00002-of-00002.safetensors", 1, ("t3", "t4", "t5")),
    ]
    assert [f.nbytes for f in plan] == [120, 120]
    # a dominant tensor: its owner holds its byte midpoint, the others share the rest
    plan = shard_plan(_specs([1, 1, 100, 1, 1]), world_size=4, max_shard_bytes=10**6)
    assert [(f.owner, f.tensors) for f in plan] == [(0, ("t0", "t1")), (2, ("t2",)), (3, ("t3", "t4"))]


def test_shard_plan_cuts_files_at_the_limit_and_names_a_single_file_like_hf():
    plan = shard_plan(_specs([4, 4, 4, 20, 4]), world_size=1, max_shard_bytes=32)
    assert [f.tensors for f in plan] == [("t0", "t1"), ("t2",), ("t3",), ("t4",)]  # 80 B alone, over the limit
    assert [f.name for f in plan][-1] == "model-00004-of-00004.safetensors" and {f.owner for f in plan} == {0}
    assert [f.name for f in shard_plan(_specs([4, 4]), 3, 10**6)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]  # 3 ranks, 2 tensors: 2 writers
    assert [f.name for f in shard_plan(_specs([4, 4]), 1, 10**6)] == ["model.safetensors"]
    with pytest.raises(ValueError, match="at least one tensor"):
        shard_plan([], 1, 10)
    with pytest.raises(ValueError, match="max_shard_bytes"):
        shard_plan(_specs([1]), 1, 0)


@pytest.mark.parametrize("moe, tie", [(False, True), (True, False)], ids=["dense_tied", "moe"])
def test_stream_follows_the_specs_and_equals_the_whole_conversion(moe, tie):
    torch.manual_seed(0)
    model = build_model(tiny_config(moe, tie=tie))
    specs = hf_tensor_specs(model, torch.bfloat16)
    streamed = list(iter_hf_tensors(model, torch.bfloat16))
    assert [(n, tuple(t.shape), t.dtype) for n, t in streamed] == [(s.name, s.shape, s.dtype) for s in specs]
    whole = to_hf_state_dict(dict(model.state_dict()), model.arch)
    assert dict(streamed).keys() == whole.keys()
    for name, tensor in streamed:
        assert torch.equal(tensor, whole[name].to(torch.bfloat16)), name
    # units: a decoder layer's tensors come together
    layer0 = [i for i, (n, _) in enumerate(streamed) if n.startswith("model.language_model.layers.0.")]
    assert layer0 == list(range(layer0[0], layer0[0] + len(layer0)))


def test_save_replaces_an_earlier_save_in_the_same_directory(tmp_path):
    torch.manual_seed(0)
    model = build_model(tiny_config())
    plan = save_pretrained(model, tmp_path, max_shard_bytes=20_000)
    assert len(plan) > 1 and sum(f.nbytes for f in plan) == sum(s.nbytes for s in hf_tensor_specs(model))
    save_pretrained(model, tmp_path)  # one file now: the earlier shards and index must go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    _assert_same_state(model, from_pretrained(tmp_path, dtype=torch.float32))
