import asyncio

import numpy as np
import pytest

from osvl.rl.trajectory import ToolCall, ToolStatus
from osvl.tools import ToolCache, ToolEnvironment, ToolLimits, VisualContext


def test_images_are_resolved_by_index_and_outputs_join_the_context(fault_env):
    context = VisualContext([np.full((4, 4, 3), 10, np.uint8), np.full((2, 2, 3), 20, np.uint8)])
    result = fault_env.execute_sync({"name": "echo_image", "arguments": {"image": 1, "tag": "t"}}, context)
    assert result.status is ToolStatus.OK, result.error
    assert result.text.endswith("New image at index 2.")
    assert np.all(context.resolve(2) == 21) and context.resolve(2).shape == (2, 2, 3)


@pytest.mark.parametrize(
    "raw, status, message",
    [
        ('{"name": "echo_image", "arguments": {"image": 5}}', ToolStatus.TOOL_ERROR, "image index 5 does not exist"),
        ('{"name": "echo_image", "arguments": {"image": 0', ToolStatus.PARSE_ERROR, "not valid JSON"),
        ('{"name": "nope", "arguments": {}}', ToolStatus.PARSE_ERROR, "unknown tool"),
        ('{"name": "echo", "arguments": {"url": "http://x"}}', ToolStatus.INVALID_ARGUMENTS, "unknown argument"),
        ('{"name": "echo", "arguments": {"seconds": -1}}', ToolStatus.INVALID_ARGUMENTS, "must be >= 0"),
        ('{"name": "echo", "arguments": {"seconds": ' + "9" * 400 + "}}", ToolStatus.INVALID_ARGUMENTS, "out of range"),
        ('{"name": "echo", "arguments": {"tag": "\\udc80"}}', ToolStatus.INVALID_ARGUMENTS, "lone surrogate"),
    ],
)
def test_bad_calls_never_reach_a_worker(fault_env, raw, status, message):
    before = fault_env.pool.stats.submitted
    context = VisualContext([np.zeros((2, 2, 3), np.uint8)])
    result = fault_env.execute_sync(raw, context)
    assert result.status is status and message in result.error
    assert fault_env.pool.stats.submitted == before and len(context) == 1
    if status is ToolStatus.INVALID_ARGUMENTS:
        assert result.tool == "echo"


def test_async_execute_and_deadline_override(fault_env):
    context = VisualContext()
    result = asyncio.run(fault_env.execute(ToolCall("echo", {"tag": "a", "seconds": 1.0}), context, deadline_s=0.2))
    assert result.status is ToolStatus.TIMEOUT and result.tool == "echo"
    with pytest.raises(ValueError, match="deadline_s must be positive"):
        fault_env.execute_sync(ToolCall("echo", {}), context, deadline_s=-1)


def test_full_visual_context_is_a_tool_error(fault_env):
    context = VisualContext([np.zeros((2, 2, 3), np.uint8)], ToolLimits(max_context_images=1))
    result = fault_env.execute_sync({"name": "echo_image", "arguments": {"image": 0}}, context)
    assert result.status is ToolStatus.TOOL_ERROR and "cannot take 1 more" in result.error


def test_record_then_replay_cache(fault_pool, fault_registry, tmp_path):
    path = tmp_path / "cache.sqlite"
    image = np.full((3, 3, 3), 7, np.uint8)
    call = {"name": "cached_echo", "arguments": {"image": 0, "tag": "q"}}
    recorder = ToolEnvironment(fault_registry, fault_pool, ToolCache(path, "record"))
    first = recorder.execute_sync(call, VisualContext([image]))
    second = recorder.execute_sync(call, VisualContext([image]))
    assert first.status is second.status is ToolStatus.OK
    assert second.text == first.text and np.array_equal(second.images[0], first.images[0])
    assert (recorder.cache.stats.hits, recorder.cache.stats.misses, recorder.cache.stats.stores) == (1, 1, 1)
    assert recorder.cache.stats.hit_rate == 0.5
    recorder.execute_sync({"name": "echo", "arguments": {"tag": "q"}}, VisualContext())  # not cacheable
    assert recorder.cache.stats.hits + recorder.cache.stats.misses == 2
    recorder.cache.close()

    submitted = fault_pool.stats.submitted
    replayer = ToolEnvironment(fault_registry, fault_pool, ToolCache(path, "replay"))
    again = replayer.execute_sync(call, VisualContext([image]))
    assert again.status is ToolStatus.OK and again.text == first.text
    other_image = replayer.execute_sync(call, VisualContext([image + 1]))
    assert other_image.status is ToolStatus.INFRA_ERROR and "no recorded result" in other_image.error
    assert fault_pool.stats.submitted == submitted  # replay never ran the tool
    assert replayer.cache.stats.hit_rate == 0.5
    with pytest.raises(ValueError, match="cache mode"):
        ToolCache(path, "sometimes")


def test_long_observations_are_truncated_with_a_note(fault_env):
    context = VisualContext(limits=ToolLimits(max_observation_chars=10))
    result = fault_env.execute_sync({"name": "echo", "arguments": {"tag": "abcdefghijklmnop"}}, context)
    assert result.status is ToolStatus.OK
    assert result.text.startswith("echo:abcde\n[truncated ") and result.text.endswith(" characters]")


def test_a_specs_options_travel_with_its_jobs_and_must_be_named_like_arguments(fault_pool):
    from osvl.tools import ToolRegistry, ToolSpec

    params = {"type": "object", "properties": {}}
    spec = ToolSpec("opt", "d", params, "tests.tools.fault_tools:echo_options", options={"limit": 3})
    env = ToolEnvironment(ToolRegistry([spec]), fault_pool)
    job = env.prepare({"name": "opt", "arguments": {}}, VisualContext(), end_to_end_s=7.0)
    assert job.options == {"limit": 3} and job.end_to_end_s == 7.0
    result = env.execute_sync({"name": "opt", "arguments": {}}, VisualContext())
    assert result.status is ToolStatus.OK and result.text == '{"limit": 3}'
    with pytest.raises(ValueError, match="option names must be identifiers"):
        ToolSpec("opt", "d", params, "m:f", options={"not a name": 1})
