"""The recipe keys that choose python_interpreter's boundary, and the check before any tool runs."""

import re

import pytest

from osvl.config.loader import load_recipe
from osvl.tools.sandbox import SandboxConfig
from osvl.trainer.tool_env import check_recipe_sandbox, recipe_profile, recipe_sandbox


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["tools.python_sandbox=none"], "tools.python_sandbox: 'none' is not one of"),
        (
            ["tools.python_sandbox=sandbox_fusion"],
            "tools: python_sandbox 'sandbox_fusion' needs an http(s) sandbox_fusion_url",
        ),
    ],
)
def test_bad_sandbox_keys_are_refused_before_anything_starts(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_recipe("tiny_grpo", overrides)


def test_the_recipe_sandbox_reaches_the_spec():
    recipe = load_recipe(
        "tiny_grpo",
        [
            "tools.python_interpreter=true",
            "tools.python_sandbox=sandbox_fusion",
            "tools.sandbox_fusion_url=http://127.0.0.1:9",
        ],
    )
    assert recipe_sandbox(recipe) == SandboxConfig("sandbox_fusion", fusion_url="http://127.0.0.1:9")
    spec = recipe_profile(recipe).registry.get("python_interpreter")
    assert spec.options["sandbox"] == recipe_sandbox(recipe)
    with pytest.raises(ValueError, match=r"^tools\.python_sandbox: .*unreachable.*'unsafe_no_boundary'"):
        check_recipe_sandbox(recipe)  # nothing listens there: the run stops before step 1, saying what to set


def test_the_default_boundary_passes_the_check_and_unsafe_must_be_named():
    check_recipe_sandbox(load_recipe("tiny_grpo", ["tools.python_interpreter=true"]))
    unsafe = load_recipe("tiny_grpo", ["tools.python_interpreter=true", "tools.python_sandbox=unsafe_no_boundary"])
    check_recipe_sandbox(unsafe)
    assert "isolated" not in recipe_profile(unsafe).registry.get("python_interpreter").description
    assert load_recipe("tiny_grpo").tools.python_sandbox == "namespaces"
