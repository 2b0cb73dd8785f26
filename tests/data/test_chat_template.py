"""The exported chat template against ChatRenderer, through transformers' own apply_chat_template.

The model directory is the one ``osvl.trainer.export`` writes (tokenizer.json, tokenizer_config.json
with the template, preprocessor_config.json); transformers loads its tokenizer and image processor,
and its Qwen3-VL processor expands the image pads, so equal ids mean equal prompts for a server.
"""

from __future__ import annotations

import json

import jinja2
import numpy as np
import pytest
import transformers

from osvl.data.chat import ChatRenderer, parse_system_text, system_text
from osvl.data.chat_template import chat_template, render_chat_template, trained_prompt
from osvl.data.image import ImageConfig, pixel_values
from osvl.rl.trajectory import Prompt
from osvl.tools.profiles import tool_profile
from osvl.trainer.export import PolicyDefaults, model_files
from tests.data.helpers import TOOLS, rgb, search_trajectory, tiny_tokenizer

IMAGES = ImageConfig(min_pixels=32 * 32, max_pixels=32 * 32 * 8, resample="pil")  # transformers' PIL processor
RELEASE_TOOLS = tool_profile("release").tool_schemas()
TRICKY = 'Say "hi" \\ {{ not jinja }} {% raw %} \u00e9\u20ac\U0001f600\ttab\nnew line'
PROMPTS = {  # name -> (system prompt, tools shown)
    "none": ("", []),
    "system_only": ("You are a search agent.", []),
    "tools_only": ("", TOOLS),
    "release": ("Answer inside <response></response>.", RELEASE_TOOLS),
    "tricky": (TRICKY, TOOLS[:1]),
}


class ImageQwen3VLProcessor(transformers.Qwen3VLProcessor):
    """transformers' Qwen3-VL processor without its video half, which needs torchvision (not on the
    CPU test machines); the image path and the chat template are transformers' own."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def write_dir(path, system_prompt, tools):
    defaults = PolicyDefaults(system_prompt, tuple(tools))
    for name, text in model_files(tiny_tokenizer(), IMAGES, defaults, max_length=4096).items():
        (path / name).write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module", params=list(PROMPTS))
def exported(request, tmp_path_factory):
    system_prompt, tools = PROMPTS[request.param]
    path = write_dir(tmp_path_factory.mktemp(request.param), system_prompt, tools)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    processor = ImageQwen3VLProcessor.from_pretrained(path)  # its template from chat_template.jinja
    assert processor.chat_template == tokenizer.chat_template
    renderer = ChatRenderer(tiny_tokenizer(), IMAGES, tools, system_prompt)
    return path, tokenizer, processor, renderer


def user(question, images):
    return {
        "role": "user",
        "content": [*({"type": "image", "image": im} for im in images), {"type": "text", "text": question}],
    }


def tool(text, images=()):
    return {
        "role": "tool",
        "content": [*({"type": "image", "image": im} for im in images), {"type": "text", "text": text}],
    }


def processor_ids(processor, messages, **kwargs):
    out = processor.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    return list(out["input_ids"][0]), out


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_prompt_ids_equal_the_renderers(exported, n_images):
    _, _, processor, renderer = exported
    images = [rgb(64, 96, 1), rgb(50, 30, 2)][:n_images]
    prompt = Prompt(id="q", question="When did this bridge open? 1982 or 47,790?", images=images, answer="")
    segment = renderer.render_prompt(prompt)
    ids, out = processor_ids(processor, [user(prompt.question, images)], add_generation_prompt=True)
    assert ids == segment.ids
    if images:  # the image processor the directory configures patches images as the trainer does
        assert out["image_grid_thw"].tolist() == [list(p.grid_thw) for p in segment.images]
        # same resized pixels: one uint8 level is 2/255 after normalisation; 1e-6 is float rounding
        np.testing.assert_allclose(
            np.asarray(out["pixel_values"]), pixel_values(segment.images, IMAGES), rtol=0, atol=1e-6
        )


def test_multi_turn_contexts_equal_the_renderers(exported):
    """Each generation's context (prompt, earlier steps, tool observations with images) and the whole
    conversation, with the steps' text as assistant turns."""
    _, tokenizer, processor, renderer = exported
    traj = search_trajectory(tiny_tokenizer())
    rendered = renderer.render_trajectory(traj)
    messages = [user(traj.prompt.question, traj.prompt.images)]
    context = list(renderer.render_prompt(traj.prompt).ids)
    for index, step in enumerate(traj.steps[:-1]):
        context += step.token_ids + renderer.render_observation(step).ids
        messages += [{"role": "assistant", "content": step.text}, tool(step.observation_text, step.observation_images)]
        ids, _ = processor_ids(processor, messages, add_generation_prompt=True)
        assert ids == context, f"context of step {index + 1}"
        assert ids == list(rendered.input_ids[: len(ids)])
    messages.append({"role": "assistant", "content": traj.steps[-1].text})
    ids, _ = processor_ids(processor, messages)
    assert ids == [*rendered.input_ids, tokenizer.convert_tokens_to_ids("\u010a")]  # the template closes with "\n"


def test_our_renderer_renders_as_transformers(exported):
    """osvl.eval renders templates without transformers: same text for every feature of the template."""
    path, tokenizer, _, _ = exported
    template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    assert json.loads((path / "tokenizer_config.json").read_text())["chat_template"] == template
    call = {"type": "function", "function": {"name": "text_search", "arguments": {"query": "Kessock"}}}
    conversations = [
        ([user("q?", [rgb(8, 8, 0)])], {"add_generation_prompt": True}),
        ([{"role": "system", "content": "Other prompt."}, user("q?", [])], {"tools": []}),
        ([{"role": "system", "content": [{"type": "text", "text": "Parts."}]}, user("q?", [])], {"tools": [TOOLS[1]]}),
        (
            [
                user("q?", []),
                {"role": "assistant", "content": "<think>t</think>", "tool_calls": [call, call]},
                tool("first"),
                tool("second", [rgb(8, 8, 1)]),
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "r",
                    "tool_calls": [{"name": "crop", "arguments": '{"box": [1, 2, 3, 4]}'}],
                },
            ],
            {"add_generation_prompt": True, "tools": RELEASE_TOOLS},
        ),
    ]
    for messages, kwargs in conversations:
        theirs = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        assert render_chat_template(template, messages, **kwargs) == theirs


def test_arguments_replace_the_trained_defaults(tmp_path):
    template = chat_template("Trained prompt.", RELEASE_TOOLS)
    question = [{"role": "user", "content": "q?"}]
    assert render_chat_template(template, question) == system_text(RELEASE_TOOLS, "Trained prompt.") + (
        "<|im_start|>user\nq?<|im_end|>\n"
    )
    system = [{"role": "system", "content": "New."}, *question]
    assert render_chat_template(template, system, tools=[]).startswith("<|im_start|>system\nNew.<|im_end|>\n")
    assert render_chat_template(template, system, tools=TOOLS).startswith(system_text(TOOLS, "New."))
    assert render_chat_template(template, [{"role": "system", "content": ""}, *question], tools=[]) == (
        "<|im_start|>user\nq?<|im_end|>\n"
    )
    with pytest.raises(ValueError, match="unexpected role narrator"):
        render_chat_template(template, [*question, {"role": "narrator", "content": "x"}])
    with pytest.raises(ValueError, match="unexpected role system"):
        render_chat_template(template, [*question, {"role": "system", "content": "late"}])
    with pytest.raises(ValueError, match="duplicate tool names"):
        chat_template("", [TOOLS[0], TOOLS[0]])


@pytest.mark.parametrize("name", list(PROMPTS))
def test_trained_prompt_reads_the_defaults_back(name):
    system_prompt, tools = PROMPTS[name]
    got_prompt, got_tools = trained_prompt(chat_template(system_prompt, tools))
    assert (got_prompt, system_text(got_tools, got_prompt)) == (system_prompt, system_text(tools, system_prompt))


def test_trained_prompt_of_foreign_and_edited_templates():
    foreign = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    assert trained_prompt(foreign) is None
    edited = chat_template("P.").replace('"<|im_start|>user\\n"', '"<|im_start|>human\\n"')
    with pytest.raises(ValueError, match="does not render a user turn"):
        trained_prompt(edited)
    with pytest.raises(ValueError, match="does not parse"):
        render_chat_template("{% if %}", [])


@pytest.mark.parametrize(
    "system_prompt, tools", [("", []), ("P.", []), ("", TOOLS), ("P.\n\nQ.", RELEASE_TOOLS), (TRICKY, TOOLS)]
)
def test_parse_system_text_inverts_system_text(system_prompt, tools):
    text = system_text(tools, system_prompt)
    prompt, parsed = parse_system_text(text)
    assert system_text(parsed, prompt) == text and prompt == system_prompt and len(parsed) == len(tools)


def test_parse_system_text_refuses_other_text():
    with pytest.raises(ValueError, match="not a system turn"):
        parse_system_text("<|im_start|>user\nhi<|im_end|>\n")
    with pytest.raises(ValueError, match="not in osvl's format"):
        parse_system_text("<|im_start|>system\n<|im_end|>\n")  # an empty prompt renders as no turn at all


def test_auto_processor_recognises_every_processor_file(tmp_path):
    """``AutoProcessor`` (what SGLang and vLLM load) finds the processor, tokenizer, image and video
    processors; on machines without torchvision it stops only at the video processor's import."""
    path = write_dir(tmp_path, "", [])
    (path / "config.json").unlink(missing_ok=True)
    try:
        processor = transformers.AutoProcessor.from_pretrained(path)
    except ImportError as error:
        assert "Torchvision" in str(error)
        assert transformers.AutoImageProcessor.from_pretrained(path).merge_size == IMAGES.merge_size
    else:
        assert type(processor).__name__ == "Qwen3VLProcessor"
        assert processor.video_processor.merge_size == IMAGES.merge_size


def _loops_over_message_content(template: str) -> bool:
    node_is = jinja2.nodes
    for loop in jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template).find_all(node_is.For):
        it = loop.iter
        if (
            isinstance(it, node_is.Getattr)
            and it.attr == "content"
            or (isinstance(it, node_is.Getitem) and isinstance(it.arg, node_is.Const) and it.arg.value == "content")
        ):
            if isinstance(it.node, node_is.Name) and it.node.name == "message":
                return True
    return False


def test_servers_pass_images_to_the_template():
    """SGLang's and vLLM's chat endpoints hand a template structured content (image parts kept) only when
    its AST loops over ``message.content``; otherwise they flatten it to text and the images are lost."""
    assert _loops_over_message_content(chat_template("P.", RELEASE_TOOLS))
    assert not _loops_over_message_content("{% for m in messages %}{{ m.content }}{% endfor %}")
