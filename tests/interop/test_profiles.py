import asyncio
import json

import numpy as np
import pytest

from osvl.rl.trajectory import ToolResult, ToolStatus
from osvl.tools import ToolBackendsConfig
from osvl.tools.errors import InvalidArguments
from osvl.tools.profiles import (
    RELEASE_TOOLS,
    ProfiledEnvironment,
    image_index,
    tool_profile,
    translate_release_call,
)
from osvl.tools.visual_context import VisualContext
from osvl.tools.worker import run_job


@pytest.fixture(scope="module")
def release():
    return tool_profile("release")


@pytest.mark.parametrize(
    "call, expected",
    [
        (
            {"name": "crop", "arguments": {"image": "img_2", "x": 3, "y": 4, "width": 10, "height": 6}},
            ("crop", {"image": 1, "boxes": [[3.0, 4.0, 13.0, 10.0]], "coordinates": "pixel"}),
        ),
        (
            {"name": "layout_parsing", "arguments": {"image": "img_1", "use_chart_recognition": True}},
            ("ocr", {"image": 0, "chart_recognition": True, "doc_orientation": False}),
        ),
        (
            {"name": "text_search", "arguments": {"q": "kessock bridge", "hl": "en", "top_k": 3}},
            ("text_search", {"query": "kessock bridge", "top_k": 3}),
        ),
        (
            {"name": "text_search", "arguments": {"query": "kessock bridge", "lang": "zh"}},
            ("text_search", {"query": "kessock bridge", "top_k": 5}),
        ),
        ({"name": "web_search", "arguments": {"q": "inverness"}}, ("text_search", {"query": "inverness", "top_k": 5})),
        ({"name": "image_search", "arguments": {"url": "img_3"}}, ("image_search", {"image": 2, "top_k": 5})),
        ({"name": "perspective_correct", "parameters": {"image": "img_1"}}, ("perspective_correct", {"image": 0})),
        ({"name": "super_resolution", "arguments": {"image": "img_1"}}, ("super_resolution", {"image": 0, "scale": 4})),
        ({"name": "sharpen", "arguments": {"image": "img_1"}}, ("sharpen", {"image": 0, "amount": 1.5, "sigma": 1.0})),
        (
            {"name": "visit", "arguments": {"url": "https://x.org/a", "goal": "opening year"}},
            ("visit", {"url": "https://x.org/a", "goal": "opening year"}),
        ),
    ],
)
def test_release_call_translates_to_osvl_tool(release, call, expected):
    translated = release.translate(call)
    assert (translated.name, translated.arguments) == expected
    assert release.translate(json.dumps(call)).arguments == translated.arguments  # raw model text too


def test_release_crop_executes_the_osvl_crop_on_the_referenced_image(release):
    question = np.zeros((20, 30, 3), np.uint8)
    tool_image = np.arange(20 * 30 * 3, dtype=np.uint8).reshape(20, 30, 3)
    call = release.translate({"name": "crop", "arguments": {"image": "img_2", "x": 5, "y": 2, "width": 8, "height": 7}})
    spec = release.registry.get(call.name)
    images = [[question, tool_image][call.arguments[arg]] for arg in spec.image_args]
    status, _, out, error = run_job(spec.target, call.arguments, images, ToolBackendsConfig())
    assert status is ToolStatus.OK, error
    np.testing.assert_array_equal(out[0], tool_image[2:9, 5:13])


@pytest.mark.parametrize(
    "call, status, fragment",
    [
        ({"name": "zoom", "arguments": {}}, "parse_error", "unknown tool 'zoom'"),
        (
            {"name": "crop", "arguments": {"image": "img_1", "x": 0, "y": 0, "width": 2, "height": 2, "angle": 5}},
            "invalid_arguments",
            "unknown argument",
        ),
        ({"name": "crop", "arguments": {"image": "img_1", "x": 0}}, "invalid_arguments", "missing required"),
        ({"name": "text_search", "arguments": {"hl": "en"}}, "invalid_arguments", "exactly one of"),
        ({"name": "python_interpreter", "arguments": {"code": "print(1)"}}, "parse_error", "not enabled"),
        ("{not json", "parse_error", "not valid JSON"),
        (
            {"name": "crop", "arguments": {"image": "first", "x": 0, "y": 0, "width": 2, "height": 2}},
            "invalid_arguments",
            "img_1",
        ),
        (
            {"name": "crop", "arguments": {"image": "img_0", "x": 0, "y": 0, "width": 2, "height": 2}},
            "invalid_arguments",
            "img_1",
        ),
        (
            {"name": "crop", "arguments": {"image": "img_" + "9" * 5000, "x": 0, "y": 0, "width": 2, "height": 2}},
            "invalid_arguments",
            "img_1",
        ),
        (
            '{"name": "crop", "arguments": {"image": "img_1", "x": '
            + "1" * 5000
            + ', "y": 0, "width": 2, "height": 2}}',
            "invalid_arguments",
            "out of range",
        ),
        (
            '{"name": "crop", "parameters": {"image": "img_1", "x": 0, "y": 0, "width": 2, "height": '
            + "7" * 400
            + "}}",
            "invalid_arguments",
            "out of range",
        ),
        (
            {"name": "crop", "arguments": {"image": "img_1", "x": 0, "y": 0, "width": 0, "height": 2}},
            "invalid_arguments",
            "positive",
        ),
        (
            {"name": "layout_parsing", "arguments": {"file_path": "/etc/passwd", "image": "img_1"}},
            "tool_error",
            "file system",
        ),
        (
            {"name": "super_resolution", "arguments": {"image": "img_1", "scale": 3}},
            "invalid_arguments",
            "one of [2, 4]",
        ),
        ({"name": "web_search", "arguments": {"q": 7}}, "invalid_arguments", "must be a string"),
        ({"name": "visit", "arguments": {"url": "http://x/\ud800"}}, "invalid_arguments", "not valid Unicode"),
    ],
)
def test_bad_release_calls_are_typed_errors(release, call, status, fragment):
    result = release.prepare(call)
    assert isinstance(result, ToolResult)
    assert result.status.value == status
    assert fragment in result.error and len(result.error) < 1000


def test_paper_profile_is_the_catalog_schema_and_rejects_release_names():
    paper = tool_profile("paper")
    names = [s["function"]["name"] for s in paper.tool_schemas()]
    assert (
        names[:7]
        == ["text_search", "image_search", "sharpen", "super_resolution", "perspective_correct", "crop", "ocr"]
        and "visit" in names
        and "python_interpreter" not in names
    )
    assert paper.translate({"name": "ocr", "arguments": {"image": 0}}).arguments["chart_recognition"] is False
    assert paper.prepare({"name": "layout_parsing", "arguments": {"image": "img_1"}}).status is ToolStatus.PARSE_ERROR


def test_release_schema_is_generated_from_the_table_and_gates_python():
    off = tool_profile("release")
    on = tool_profile("release", python_interpreter=True)
    off_names = [s["function"]["name"] for s in off.tool_schemas()]
    assert off_names == [t.name for t in RELEASE_TOOLS if t.name != "python_interpreter"]
    crop = next(s for s in off.tool_schemas() if s["function"]["name"] == "crop")["function"]["parameters"]
    assert sorted(crop["properties"]) == ["height", "image", "width", "x", "y"]
    assert [s["function"]["name"] for s in on.tool_schemas()][-1] == "python_interpreter"
    assert on.translate({"name": "python_interpreter", "arguments": {"code": "print(2)"}}).name == "python_interpreter"


def test_every_release_tool_targets_a_registered_osvl_tool_and_argument():
    profile = tool_profile("release", python_interpreter=True)
    for tool in RELEASE_TOOLS:
        spec = profile.registry.get(tool.osvl)
        targets = {a.to for a in tool.args.values() if a.to} | set(tool.fixed)
        assert targets <= set(spec.parameters["properties"]), tool.name


def test_present_rewrites_image_indices_as_release_references(release):
    result = ToolResult(status="ok", tool="crop", text="New images at index 1, 2.")
    assert release.present(result).text == "New image ID: img_2, img_3."
    assert (
        tool_profile("paper").present(ToolResult(status="ok", tool="crop", text="New image at index 1.")).text
        == "New image at index 1."
    )


def test_image_index_and_unknown_profile():
    assert image_index("img_12") == 11
    with pytest.raises(InvalidArguments):
        image_index(1)
    with pytest.raises(ValueError, match="unknown tool profile"):
        tool_profile("llama")
    with pytest.raises(InvalidArguments, match="missing required"):
        translate_release_call(RELEASE_TOOLS[0], {"image": "img_1"})


class RecordingRunner:
    """Stands in for the worker pool: records the job, answers with one new image."""

    def __init__(self) -> None:
        self.jobs: list = []

    def call(self, job):
        self.jobs.append(job)
        return ToolResult(status=ToolStatus.OK, tool=job.tool, text="done", images=[np.zeros((4, 4, 3), np.uint8)])

    async def acall(self, job):
        return self.call(job)


@pytest.mark.parametrize("run", ["sync", "async"])
def test_profiled_environment_translates_in_and_presents_out(run):
    runner = RecordingRunner()
    env = ProfiledEnvironment(tool_profile("release"), runner)
    context = VisualContext([np.zeros((8, 8, 3), np.uint8)], env.registry.limits)
    call = {"name": "crop", "parameters": {"image": "img_1", "x": 1, "y": 2, "width": 3, "height": 4}}
    result = env.execute_sync(call, context) if run == "sync" else asyncio.run(env.execute(call, context))
    (job,) = runner.jobs
    assert job.tool == "crop" and job.arguments["boxes"] == [[1, 2, 4, 6]] and len(job.images) == 1
    assert result.ok and result.text == "done\nNew image ID: img_2." and len(context) == 2
    refused = env.execute_sync({"name": "ocr", "arguments": {"image": 0}}, context)  # a paper name
    assert refused.status is ToolStatus.PARSE_ERROR and "unknown tool 'ocr'" in refused.error
    assert len(runner.jobs) == 1  # a refused call never reaches the pool
