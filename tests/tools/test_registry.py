import json
import math

import numpy as np
import pytest

from osvl.rl.trajectory import ToolCall
from osvl.tools import (
    CallParseError,
    InvalidArguments,
    PoolConfig,
    ToolError,
    ToolLimits,
    ToolRegistry,
    ToolSpec,
    VisualContext,
    default_registry,
    parse_tool_call,
    tool_schemas,
)
from osvl.tools.schema import check_arguments, check_schema


def test_tool_schemas_are_openai_functions_for_the_seven_tools():
    schemas = tool_schemas()
    names = [s["function"]["name"] for s in schemas]
    assert sorted(names) == sorted(
        ["text_search", "image_search", "sharpen", "super_resolution", "perspective_correct", "crop", "ocr"]
    )
    for schema in schemas:
        assert schema["type"] == "function"
        params = schema["function"]["parameters"]
        assert params["type"] == "object" and set(params["required"]) <= set(params["properties"])
        assert schema["function"]["description"]
        json.dumps(schema)  # renderable into the prompt
        check_schema(params)


def test_schemas_carry_the_limits():
    schemas = {
        s["function"]["name"]: s["function"]["parameters"]
        for s in tool_schemas(ToolLimits(max_crops=3, max_text_chars=50))
    }
    assert schemas["crop"]["properties"]["boxes"]["maxItems"] == 3
    assert schemas["text_search"]["properties"]["query"]["maxLength"] == 50


def test_parse_fills_defaults_and_coerces_numbers():
    call = default_registry().parse('{"name": "sharpen", "arguments": {"image": 0, "amount": 2}}')
    assert call == ToolCall("sharpen", {"image": 0, "amount": 2.0, "sigma": 1.0})
    assert isinstance(call.arguments["amount"], float)
    openai_style = default_registry().parse({"name": "super_resolution", "arguments": '{"image": 1.0}'})
    assert openai_style.arguments == {"image": 1, "scale": 2}


@pytest.mark.parametrize(
    "raw, message",
    [
        ('{"name": "crop", "arguments": {"image": 0, "boxes": [[0, 0, 5, 5]]', "not valid JSON"),
        ('["crop"]', "must be a JSON object"),
        ('{"name": "draw", "arguments": {}}', "unknown tool 'draw'"),
        ('{"name": "\\ud800", "arguments": {}}', "unknown tool '\\ud800'"),
        ('{"name": "", "arguments": {}}', "non-empty string 'name'"),
        ('{"name": 7, "arguments": {}}', "non-empty string 'name'"),
        ('{"name": "ocr", "arguments": {"image": 0}, "extra": 1}', "unknown field"),
        ("[" * 100_000, "limit is"),
    ],
)
def test_malformed_calls_are_parse_errors(raw, message):
    with pytest.raises(CallParseError) as err:
        default_registry().parse(raw)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            '{"name": "crop", "arguments": {"image": 0, "boxes": [[0,0,5,5]], "path": "/etc/passwd"}}',
            "unknown argument(s) ['path']",
        ),
        ('{"name": "crop", "arguments": {"boxes": [[0,0,5,5]]}}', "missing required argument(s) ['image']"),
        ('{"name": "sharpen", "arguments": {"image": 0, "amount": NaN}}', "'amount' is the non-finite number NaN"),
        ('{"name": "sharpen", "arguments": {"image": 0, "amount": Infinity}}', "non-finite number Infinity"),
        ('{"name": "sharpen", "arguments": {"image": 0, "amount": 1e400}}', "'amount' is the number 1e400, out of"),
        ('{"name": "sharpen", "arguments": {"image": 0, "amount": -1e400}}', "out of range"),
        ('{"name": "ocr", "arguments": [1]}', "'arguments' must be a JSON object"),
        ('{"name": "ocr", "arguments": "[1]"}', "'arguments' must be a JSON object"),
        ('{"name": "ocr", "arguments": "{image: 0"}', "arguments is not valid JSON"),
        ('{"name": "ocr", "arguments": {"image": 1' + "0" * 5000 + "}}", "5001 digits"),  # int() refuses 4300+
        ('{"name": "ocr", "arguments": {"image": ' + "9" * 400 + "}}", "out of range"),
        (
            '{"name": "crop", "arguments": {"image": 0, "boxes": [[0, 0, 5, 1' + "0" * 400 + "]]}}",
            "'boxes[0][3]' is an",
        ),
        ('{"name": "ocr", "arguments": "{\\"image\\": ' + "9" * 400 + '}"}', "out of range"),
        ('{"name": "ocr", "arguments": {"image": ' + "[" * 15_000 + "]" * 15_000 + "}}", "nested too deeply"),
        ('{"name": "text_search", "arguments": {"query": "a\\ud800b"}}', "'query' is not valid Unicode text"),
        ('{"name": "text_search", "arguments": {"query": "\\udfff"}}', "lone surrogate at character 0"),
        ('{"name": "text_search", "arguments": {"\\ud800": "x", "query": "q"}}', "unknown argument(s) ['\\ud800']"),
    ],
)
def test_unusable_arguments_are_invalid_arguments(raw, message):
    with pytest.raises(InvalidArguments) as err:
        default_registry().parse(raw)
    assert message in str(err.value)
    if raw.startswith('{"name": "ocr", "arguments": {"image": 1'):
        assert len(str(err.value)) < 200  # the message quotes the number, not all of it


def test_deeply_nested_json_within_size_limit_is_invalid_arguments():
    with pytest.raises(InvalidArguments, match="nested too deeply"):
        parse_tool_call("[" * 15_000 + "]" * 15_000)


@pytest.mark.parametrize(
    "value",
    [10**400, -(10**5000), 2**53 + 1, 1e300, float("inf"), float("nan")],
    ids=["400 digits", "-5001 digits", "2**53+1", "1e300", "inf", "nan"],
)
def test_python_callers_get_the_same_typed_answer_for_huge_or_non_finite_numbers(value):
    registry = default_registry()
    with pytest.raises(InvalidArguments):
        registry.parse({"name": "sharpen", "arguments": {"image": 0, "amount": value}})
    with pytest.raises(InvalidArguments):
        registry.parse({"name": "crop", "arguments": {"image": value, "boxes": [[0, 0, 5, 5]]}})


@pytest.mark.parametrize("value", [b"bytes", {1, 2}, object(), None, [["nested"]], {"k": "v"}])
def test_python_objects_of_the_wrong_type_are_invalid_arguments(value):
    with pytest.raises(InvalidArguments, match="'query' must be a string"):
        default_registry().parse({"name": "text_search", "arguments": {"query": value}})


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"image": "0", "boxes": [[0, 0, 5, 5]]}, "'image' must be an integer, got string"),
        ({"image": 0.5, "boxes": [[0, 0, 5, 5]]}, "'image' must be an integer, got number"),
        ({"image": True, "boxes": [[0, 0, 5, 5]]}, "got boolean"),
        ({"image": -1, "boxes": [[0, 0, 5, 5]]}, "must be >= 0"),
        ({"image": 0, "boxes": [[0, 0, 5]]}, "needs at least 4 item(s)"),
        ({"image": 0, "boxes": [[0, 0, 5, 5]] * 9}, "has 9 items; the limit is 8"),
        ({"image": 0, "boxes": [[0, 0, float("nan"), 5]]}, "finite number"),
        ({"image": 0, "boxes": [[0, 0, 5, 5]], "coordinates": "inches"}, "must be one of"),
    ],
)
def test_bad_argument_values_are_invalid_arguments(arguments, message):
    with pytest.raises(InvalidArguments) as err:
        default_registry().parse({"name": "crop", "arguments": arguments})
    assert message in str(err.value)


def test_text_and_range_limits():
    registry = default_registry(ToolLimits(max_text_chars=10, max_top_k=3))
    with pytest.raises(ToolError, match="11 characters; the limit is 10"):
        registry.parse({"name": "text_search", "arguments": {"query": "x" * 11}})
    with pytest.raises(ToolError, match="at least 1 character"):
        registry.parse({"name": "text_search", "arguments": {"query": ""}})
    with pytest.raises(ToolError, match="<= 3"):
        registry.parse({"name": "text_search", "arguments": {"query": "x", "top_k": 4}})
    with pytest.raises(ToolError, match="must be one of \\[2, 4\\]"):
        registry.parse({"name": "super_resolution", "arguments": {"image": 0, "scale": 3}})


def test_nested_objects_are_checked():
    schema = {
        "type": "object",
        "properties": {"opt": {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}},
    }
    check_schema(schema)
    assert check_arguments(schema, {"opt": {"k": 2}}) == {"opt": {"k": 2}}
    with pytest.raises(InvalidArguments, match="unknown field"):
        check_arguments(schema, {"opt": {"k": 2, "z": 1}})
    with pytest.raises(InvalidArguments, match="missing field"):
        check_arguments(schema, {"opt": {}})
    with pytest.raises(InvalidArguments, match="must be a JSON object"):
        check_arguments(schema, [1])


def test_schema_checker_rejects_what_it_would_ignore():
    with pytest.raises(ValueError, match="unsupported keywords"):
        check_schema({"type": "string", "pattern": "a+"})
    with pytest.raises(ValueError, match="needs a type"):
        check_schema({"type": "null"})
    with pytest.raises(ValueError, match="undeclared"):
        check_schema({"type": "object", "properties": {}, "required": ["x"]})


def test_spec_and_registry_validation():
    params = {"type": "object", "properties": {"image": {"type": "integer"}}}
    with pytest.raises(ValueError, match="identifier"):
        ToolSpec("bad name", "d", params, "m:f")
    with pytest.raises(ValueError, match="module:function"):
        ToolSpec("t", "d", params, "m.f")
    with pytest.raises(ValueError, match="deadline_s"):
        ToolSpec("t", "d", params, "m:f", deadline_s=math.inf)
    with pytest.raises(ValueError, match="image argument"):
        ToolSpec("t", "d", params, "m:f", image_args=("picture",))
    spec = ToolSpec("t", "d", params, "m:f")
    with pytest.raises(ValueError, match="registered twice"):
        ToolRegistry([spec, spec])
    registry = ToolRegistry([spec])
    assert "t" in registry and registry.names == ["t"]


def test_limits_validate():
    with pytest.raises(ValueError, match="max_crops"):
        ToolLimits(max_crops=0)


def test_visual_context_indices_and_limits():
    red = np.zeros((4, 5, 3), np.uint8)
    context = VisualContext([red], ToolLimits(max_image_pixels=100, max_context_images=2))
    assert context.append(red + 1) == 1
    assert context.resolve(1)[0, 0, 0] == 1
    with pytest.raises(ToolError, match="valid indices are 0..1"):
        context.resolve(2)
    with pytest.raises(ToolError, match="integer index"):
        context.resolve("0")
    with pytest.raises(ValueError, match="already holds 2"):
        context.append(red)
    with pytest.raises(ValueError, match="exceeds the limit of 100"):
        VisualContext([np.zeros((11, 10, 3), np.uint8)], ToolLimits(max_image_pixels=100))
    with pytest.raises(ValueError, match="uint8"):
        VisualContext([np.zeros((4, 4, 3), np.float32)])
    with pytest.raises(ToolError, match="no image"):
        VisualContext().resolve(0)


@pytest.mark.parametrize("bad", ["no_colon", "module:", ":function", "a b:c", "m:f:g"])
def test_specs_and_pool_preloads_share_one_target_rule(bad):
    """A target a spec accepts is one a pool can preload, and the other way round."""
    params = {"type": "object", "properties": {}}
    with pytest.raises(ValueError, match="module:function"):
        ToolSpec("t", "d", params, bad)
    with pytest.raises(ValueError, match="module:function"):
        PoolConfig(preload=(bad,))
    assert ToolSpec("t", "d", params, "pkg.module:fn").target in PoolConfig(preload=("pkg.module:fn",)).preload
