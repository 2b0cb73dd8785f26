"""SGLang's and vLLM's client configs refuse the same bad fleets, each naming itself."""

from __future__ import annotations

import pytest

from osvl.rollout import SGLangConfig, VLLMConfig

GOOD = ("http://127.0.0.1:30000",)


@pytest.mark.parametrize("config", [SGLangConfig, VLLMConfig])
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"urls": ()}, r"\.urls needs http\(s\) base URLs"),
        ({"urls": ("127.0.0.1:30000",)}, r"\.urls needs http\(s\) base URLs"),
        ({"urls": GOOD, "update_urls": ("ftp://host",)}, r"\.update_urls needs http\(s\) base URLs"),
        ({"urls": GOOD, "routing": "random"}, "unknown routing 'random'"),
        ({"urls": GOOD, "timeout_s": 0.0}, "timeout_s must be positive"),
    ],
)
def test_bad_fleets_are_refused_by_both_engines(config, kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        config(**kwargs)
    if "urls" in message:
        assert str(error.value).startswith(config.__name__)


@pytest.mark.parametrize("config", [SGLangConfig, VLLMConfig])
def test_weight_updates_go_to_the_generation_urls_unless_named(config):
    assert config(GOOD).weight_urls == GOOD
    assert config(GOOD, update_urls=("http://a:1",)).weight_urls == ("http://a:1",)
