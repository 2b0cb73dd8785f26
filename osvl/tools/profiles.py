"""Tool-schema profiles: the tool names and arguments a checkpoint was trained with.

``paper`` is osvl's own schema (the catalog's tools, images as integer indices). ``release`` is
the protocol of the released OpenSearch-VL checkpoints: their tool names and argument names,
images referenced as ``"img_1"`` (the question image), ``"img_2"``, ... in order of appearance.
:data:`RELEASE_TOOLS` is the one table that says how each release tool maps onto an osvl tool;
the schema the model sees and the translation of its calls back are both read from it, so they
cannot drift apart. The descriptions are ours; the names, arguments and defaults are the release's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from osvl.rl.trajectory import ToolCall, ToolResult
from osvl.tools.cache import ToolCache
from osvl.tools.catalog import builtin_specs
from osvl.tools.environment import RawCall, ToolEnvironment, ToolRunner
from osvl.tools.errors import CallParseError, InvalidArguments, ToolError, error_status
from osvl.tools.limits import ToolLimits
from osvl.tools.pool import Job
from osvl.tools.python_interpreter import python_interpreter_spec
from osvl.tools.registry import ToolRegistry, ToolSpec, parse_tool_call
from osvl.tools.sandbox import SandboxConfig
from osvl.tools.schema import check_arguments
from osvl.tools.visit import visit_spec
from osvl.tools.visual_context import VisualContext

PROFILES = ("paper", "release")
_IMAGE_REF = re.compile(r"img_([1-9][0-9]{0,5})")  # far more images than a context may hold


@dataclass(frozen=True)
class Arg:
    """One release argument: its JSON schema and what it becomes in the osvl call.

    ``to`` names the osvl argument; ``None`` means accepted and dropped (``why`` says why).
    ``kind``: ``value`` (copied), ``image`` (``img_N`` -> index N-1), ``box`` (one of x/y/width/height,
    assembled into a pixel box), ``refuse`` (known to the release, not served by osvl: ``tool_error``).
    """

    schema: dict[str, Any]
    to: str | None = None
    kind: str = "value"
    why: str = ""


@dataclass(frozen=True)
class ReleaseTool:
    name: str
    osvl: str
    description: str
    args: dict[str, Arg]
    required: tuple[str, ...] = ()
    one_of: tuple[str, ...] = ()  # aliases of which exactly one must be given
    fixed: dict[str, Any] = field(default_factory=dict)  # osvl arguments the mapping sets

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": {k: dict(a.schema) for k, a in self.args.items()},
                    "required": list(self.required),
                },
            },
        }


def _s(kind: str, description: str = "", **extra: Any) -> dict[str, Any]:
    return {"type": kind, **({"description": description} if description else {}), **extra}


_REF = "Image reference: 'img_1' is the question image, tool results are img_2, img_3, ..."
_LANG = "the osvl search backends are language-agnostic"

RELEASE_TOOLS: tuple[ReleaseTool, ...] = (
    ReleaseTool(
        "crop",
        "crop",
        "Cut a rectangle out of an image (pixels); the cut becomes a new image.",
        {
            "image": Arg(_s("string", _REF), "image", "image"),
            "x": Arg(_s("integer", "Left edge."), "boxes", "box"),
            "y": Arg(_s("integer", "Top edge."), "boxes", "box"),
            "width": Arg(_s("integer", "Width."), "boxes", "box"),
            "height": Arg(_s("integer", "Height."), "boxes", "box"),
        },
        required=("image", "x", "y", "width", "height"),
        fixed={"coordinates": "pixel"},
    ),
    ReleaseTool(
        "layout_parsing",
        "ocr",
        "Read the text of a document image as layout blocks.",
        {
            "image": Arg(_s("string", _REF), "image", "image"),
            "file_path": Arg(
                _s("string", "Not supported: use image."),
                kind="refuse",
                why="tools never read the host file system; pass an image reference",
            ),
            "use_chart_recognition": Arg(_s("boolean", default=False), "chart_recognition"),
            "use_doc_orientation_classify": Arg(_s("boolean", default=False), "doc_orientation"),
        },
        required=("image",),
    ),
    ReleaseTool(
        "text_search",
        "text_search",
        "Search the web; returns titles, URLs and short summaries.",
        {
            "q": Arg(_s("string", "Search query."), "query"),
            "query": Arg(_s("string", "Same as q."), "query"),
            "hl": Arg(_s("string", default="en"), why=_LANG),
            "lang": Arg(_s("string", default="en"), why=_LANG),
            "top_k": Arg(_s("integer", "Number of results.", default=5), "top_k"),
        },
        one_of=("q", "query"),
    ),
    ReleaseTool(
        "web_search",
        "text_search",
        "Search the web for up-to-date information.",
        {"q": Arg(_s("string", "Search query."), "query"), "hl": Arg(_s("string", default="en"), why=_LANG)},
        required=("q",),
    ),
    ReleaseTool(
        "image_search",
        "image_search",
        "Find web pages showing an image (reverse image search).",
        {"url": Arg(_s("string", _REF), "image", "image")},
        required=("url",),
    ),
    ReleaseTool(
        "perspective_correct",
        "perspective_correct",
        "Rectify a skewed photo of a document.",
        {"image": Arg(_s("string", _REF), "image", "image")},
        required=("image",),
    ),
    ReleaseTool(
        "super_resolution",
        "super_resolution",
        "Upscale a low-resolution image.",
        {
            "image": Arg(_s("string", _REF), "image", "image"),
            "scale": Arg(_s("integer", "2 or 4.", default=4), "scale"),
        },
        required=("image",),
    ),
    ReleaseTool(
        "sharpen",
        "sharpen",
        "Sharpen a blurry image.",
        {
            "image": Arg(_s("string", _REF), "image", "image"),
            "amount": Arg(_s("number", "Strength.", default=1.5), "amount"),
        },
        required=("image",),
    ),
    ReleaseTool(
        "visit",
        "visit",
        "Open a web page and read its text.",
        {
            "url": Arg(_s("string", "The page URL."), "url"),
            "goal": Arg(_s("string", "What to look for on the page."), "goal"),
        },
        required=("url",),
    ),
    ReleaseTool(
        "python_interpreter",
        "python_interpreter",
        "Run Python code; returns what it prints.",
        {"code": Arg(_s("string", "Python source; print() the results."), "code")},
        required=("code",),
    ),
)


def image_index(reference: Any) -> int:
    """``"img_3"`` -> 2; anything else is the policy's mistake."""
    match = _IMAGE_REF.fullmatch(reference) if isinstance(reference, str) else None
    if match is None:
        raise InvalidArguments(f"image reference must look like 'img_1' (the question image), got {reference!r:.80}")
    return int(match[1]) - 1


def translate_release_call(tool: ReleaseTool, arguments: Mapping[str, Any]) -> ToolCall:
    """A validated release call as the osvl call that executes it."""
    properties = {k: a.schema for k, a in tool.args.items()}
    given = check_arguments(
        {"type": "object", "properties": properties, "required": list(tool.required)}, dict(arguments)
    )
    if tool.one_of:
        present = [k for k in tool.one_of if k in arguments]
        if len(present) != 1:
            raise InvalidArguments(f"{tool.name} needs exactly one of {list(tool.one_of)}, got {present or 'none'}")
    out: dict[str, Any] = dict(tool.fixed)
    box: dict[str, int] = {}
    for name, value in given.items():
        arg = tool.args[name]
        if arg.kind == "refuse":
            raise ToolError(f"{tool.name}: argument '{name}' is not supported: {arg.why}")
        if arg.to is None:
            continue
        if arg.kind == "image":
            out[arg.to] = image_index(value)
        elif arg.kind == "box":
            box[name] = value
        else:
            out[arg.to] = value
    if box:
        if box["width"] <= 0 or box["height"] <= 0:
            raise InvalidArguments(f"crop width and height must be positive, got {box['width']} x {box['height']}")
        out["boxes"] = [[box["x"], box["y"], box["x"] + box["width"], box["y"] + box["height"]]]
    return ToolCall(name=tool.osvl, arguments=out)


class ToolProfile:
    """What the model sees (``tool_schemas``) and how its calls reach osvl's tools (``translate``)."""

    def __init__(
        self,
        name: str,
        limits: ToolLimits | None = None,
        python_interpreter: bool = False,
        sandbox: SandboxConfig | None = None,
    ) -> None:
        if name not in PROFILES:
            raise ValueError(f"unknown tool profile {name!r}; expected one of {PROFILES}")
        self.name = name
        specs: list[ToolSpec] = [*builtin_specs(limits or ToolLimits()), visit_spec(limits)]
        if python_interpreter:
            specs.append(python_interpreter_spec(sandbox=sandbox or SandboxConfig()))
        self.registry = ToolRegistry(specs, limits)
        self.release_tools = {t.name: t for t in RELEASE_TOOLS if t.osvl in self.registry}

    def tool_schemas(self) -> list[dict[str, Any]]:
        if self.name == "paper":
            return self.registry.tool_schemas()
        return [tool.schema() for tool in self.release_tools.values()]

    def translate(self, raw: str | Mapping[str, Any] | ToolCall) -> ToolCall:
        """The osvl call for a model's call; ``CallParseError``/``InvalidArguments``/``ToolError`` say what
        was wrong."""
        return self._translate(parse_tool_call(_arguments_key(raw), self.registry.limits))

    def _translate(self, call: ToolCall) -> ToolCall:
        if self.name == "paper":
            return self.registry.parse(call)
        tool = self.release_tools.get(call.name)
        if tool is None:
            if any(t.name == call.name for t in RELEASE_TOOLS):
                raise CallParseError(
                    f"tool {call.name!r} is not enabled here; available tools: {', '.join(self.release_tools)}"
                )
            raise CallParseError(f"unknown tool {call.name!r}; available tools: {', '.join(self.release_tools)}")
        return self.registry.parse(translate_release_call(tool, call.arguments))

    def prepare(self, raw: str | Mapping[str, Any] | ToolCall) -> ToolCall | ToolResult:
        """``translate`` with failures as the typed result the trajectory records."""
        name = ""
        try:
            call = parse_tool_call(_arguments_key(raw), self.registry.limits)
            name = call.name
            return self._translate(call)
        except (CallParseError, ToolError) as err:
            return ToolResult(status=error_status(err), tool=name or getattr(err, "tool", ""), error=str(err))

    def present(self, result: ToolResult) -> ToolResult:
        """Rewrite osvl's "New image at index 2." note into the release's ``img_3`` references."""
        if self.name == "paper" or not result.text:
            return result
        result.text = _INDEX_NOTE.sub(
            lambda m: "New image ID: " + ", ".join(f"img_{int(i) + 1}" for i in m[1].split(", ")) + ".", result.text
        )
        return result


def _arguments_key(raw: str | Mapping[str, Any] | ToolCall) -> str | Mapping[str, Any] | ToolCall:
    """The release also writes ``"parameters"`` where OpenAI style says ``"arguments"``."""
    if isinstance(raw, str):
        try:
            decoded = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, or numbers Python will not convert
            return raw  # parse_tool_call reports it
        raw = decoded if isinstance(decoded, Mapping) else raw
    if isinstance(raw, Mapping) and "parameters" in raw and "arguments" not in raw:
        return {"arguments" if k == "parameters" else k: v for k, v in raw.items()}
    return raw


_INDEX_NOTE = re.compile(r"New images? at index ([0-9]+(?:, [0-9]+)*)\.")


def tool_profile(
    name: str, limits: ToolLimits | None = None, python_interpreter: bool = False, sandbox: SandboxConfig | None = None
) -> ToolProfile:
    return ToolProfile(name, limits, python_interpreter, sandbox)


class ProfiledEnvironment(ToolEnvironment):
    """A :class:`ToolEnvironment` that speaks a tool profile: calls are translated before osvl
    validates them, and observations name new images the profile's way."""

    def __init__(self, profile: ToolProfile, pool: ToolRunner, cache: ToolCache | None = None) -> None:
        super().__init__(profile.registry, pool, cache)
        self.profile = profile

    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.profile.tool_schemas()

    def prepare(
        self, raw: RawCall, context: VisualContext, deadline_s: float | None = None, end_to_end_s: float | None = None
    ) -> Job | ToolResult:
        call = self.profile.prepare(raw)
        if isinstance(call, ToolResult):
            return call
        return super().prepare(call, context, deadline_s, end_to_end_s)

    async def execute(
        self, raw: RawCall, context: VisualContext, deadline_s: float | None = None, end_to_end_s: float | None = None
    ) -> ToolResult:
        return self.profile.present(await super().execute(raw, context, deadline_s, end_to_end_s))

    def execute_sync(
        self, raw: RawCall, context: VisualContext, deadline_s: float | None = None, end_to_end_s: float | None = None
    ) -> ToolResult:
        return self.profile.present(super().execute_sync(raw, context, deadline_s, end_to_end_s))


def profile_environment(profile: ToolProfile, pool: ToolRunner, cache: ToolCache | None = None) -> ToolEnvironment:
    """osvl's own protocol runs as is; another profile is translated on the way in and out."""
    if profile.name == "paper":
        return ToolEnvironment(profile.registry, pool, cache)
    return ProfiledEnvironment(profile, pool, cache)
