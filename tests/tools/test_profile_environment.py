import asyncio

import numpy as np

from osvl.rl.trajectory import ToolResult, ToolStatus
from osvl.tools import ToolCache, ToolEnvironment, VisualContext, tool_profile
from osvl.tools.profiles import ProfiledEnvironment, profile_environment


class CannedRunner:
    """The worker pool's interface, answering every job with one new image."""

    def __init__(self) -> None:
        self.tools: list[str] = []

    async def acall(self, job):
        self.tools.append(job.tool)
        return ToolResult(status=ToolStatus.OK, tool=job.tool, text="cut", images=[np.ones((2, 2, 3), np.uint8)])


def test_paper_profile_runs_osvl_protocol_unwrapped(tmp_path):
    runner, cache = CannedRunner(), ToolCache(tmp_path / "cache.sqlite")
    env = profile_environment(tool_profile("paper"), runner, cache)
    assert type(env) is ToolEnvironment and env.pool is runner and env.cache is cache
    context = VisualContext([np.zeros((8, 8, 3), np.uint8)])
    result = asyncio.run(env.execute({"name": "crop", "arguments": {"image": 0, "boxes": [[0, 0, 4, 4]]}}, context))
    assert result.ok and result.text.endswith("New image at index 1.") and runner.tools == ["crop"]


def test_release_profile_translates_calls_and_shows_its_own_schema():
    runner = CannedRunner()
    profile = tool_profile("release")
    env = profile_environment(profile, runner)
    assert isinstance(env, ProfiledEnvironment) and env.profile is profile and env.pool is runner
    assert env.tool_schemas() == profile.tool_schemas()
    assert "layout_parsing" in {s["function"]["name"] for s in env.tool_schemas()}
    context = VisualContext([np.zeros((8, 8, 3), np.uint8)])
    call = {"name": "crop", "arguments": {"image": "img_1", "x": 0, "y": 0, "width": 4, "height": 4}}
    result = asyncio.run(env.execute(call, context))
    assert result.ok and result.text.endswith("New image ID: img_2.") and runner.tools == ["crop"]
    refused = asyncio.run(env.execute({"name": "ocr", "arguments": {"image": 0}}, context))
    assert refused.status is ToolStatus.PARSE_ERROR and runner.tools == ["crop"]
