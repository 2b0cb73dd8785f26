"""Every path-sampling rule of App. D.1 on the hand-made graph."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from osvl.synth.sampling import (
    Rejection,
    SampledPath,
    SamplingConfig,
    WalkFailure,
    next_steps,
    sample_hops,
    sample_with_retries,
    seed_reason,
    short_answer,
    skip_reason,
    stratified_seeds,
    walk,
)

from .graphs import rules_graph

CONFIG = SamplingConfig()


def test_every_trap_link_is_skipped_and_the_redirect_is_dereferenced():
    graph = rules_graph()
    steps, skipped = next_steps(graph, "Zoo_A", {"Zoo_A"}, CONFIG)
    assert steps == [("Keeper", "keeper")]  # reached through Keeper_Nick
    assert skipped == Counter(hub=1, disambiguation=1, list=1, namespace=2, missing=1)


def test_hub_threshold_is_configurable():
    graph = rules_graph()
    assert skip_reason(graph, "Big_Country", CONFIG) == "hub"
    assert skip_reason(graph, "Big_Country", SamplingConfig(hub_threshold=50_000)) is None


def test_cycles_are_skipped():
    graph = rules_graph()
    steps, skipped = next_steps(graph, "Keeper", {"Zoo_A", "Keeper"}, CONFIG)
    assert steps == [("Spouse", "spouse")] and skipped == Counter(cycle=1)


def test_two_hop_walk_reaches_a_short_answer():
    path = walk(rules_graph(), "Zoo_A", 2, random.Random(0), CONFIG)
    assert path == SampledPath(
        ("Zoo_A", "Keeper", "Spouse"), ("keeper", "spouse"), "citizenship date", "1 May 2000"
    )  # the 7-token motto is never chosen


def test_dead_end_fails_the_walk():
    failure = walk(rules_graph(), "Zoo_A", 3, random.Random(0), CONFIG)
    assert isinstance(failure, WalkFailure) and failure.reason == "dead_end"
    assert failure.skipped["cycle"] == 2 and failure.skipped["hub"] == 1


def test_answer_node_without_short_attribute_fails():
    graph = rules_graph()
    graph["Spouse"].infobox = {"motto": "one two three four five six seven"}
    failure = walk(graph, "Zoo_A", 2, random.Random(0), CONFIG)
    assert isinstance(failure, WalkFailure) and failure.reason == "no_short_answer"


def test_short_answer_never_names_a_path_node():
    page = rules_graph()["Keeper"]
    page.infobox = {"spouse name": "Spouse Person", "occupation": "zookeeper"}
    for seed in range(5):
        assert short_answer(page, ["Spouse Person"], CONFIG, random.Random(seed)) == ("occupation", "zookeeper")


def test_retry_exhaustion_drops_the_seed():
    config = SamplingConfig(hops=(3,), hop_probs=(1.0,))
    outcome = sample_with_retries(rules_graph(), "Zoo_A", random.Random(0), config, accept=lambda p: p)
    assert outcome.result is None and outcome.attempts == 10 and outcome.failures == Counter(dead_end=10)


def test_downstream_rejections_count_as_retries():
    calls = []

    def accept(path):
        calls.append(path)
        return Rejection("rewrite_failed") if len(calls) < 4 else "record"

    outcome = sample_with_retries(
        rules_graph(), "Zoo_A", random.Random(0), SamplingConfig(hops=(2,), hop_probs=(1.0,)), accept
    )
    assert outcome.result == "record" and outcome.attempts == 4 and outcome.failures == Counter(rewrite_failed=3)
    always_no = sample_with_retries(
        rules_graph(),
        "Zoo_A",
        random.Random(0),
        SamplingConfig(hops=(2,), hop_probs=(1.0,), max_retries=3),
        lambda p: Rejection("no"),
    )
    assert always_no.result is None and always_no.failures == Counter(no=3)


def test_seed_eligibility():
    graph = rules_graph()
    assert seed_reason(graph, graph["Zoo_A"], CONFIG) is None
    assert seed_reason(graph, graph["Big_Country"], CONFIG) == "hub"
    assert seed_reason(graph, graph["Small_Image_Tower"], CONFIG) == "no_large_image"
    assert seed_reason(graph, graph["Bare_Beetle"], CONFIG) == "no_infobox"
    assert seed_reason(graph, graph["Quiet_Vase"], CONFIG) == "low_in_degree"
    assert seed_reason(graph, graph["Keeper"], CONFIG) == "no_large_image"


def test_stratified_seeds_interleave_domains():
    graph = rules_graph()
    seeds = stratified_seeds(graph, CONFIG, per_domain=5, rng=random.Random(0))
    assert sorted(seeds) == ["Loud_Vase", "Zoo_A"]
    assert [graph[s].domain for s in seeds] == ["Building/Place", "Artifact"]


def test_hop_distribution_matches_the_paper():
    rng = random.Random(0)
    counts = Counter(sample_hops(rng, CONFIG) for _ in range(20_000))
    assert set(counts) == {2, 3, 4}
    for hops, share in ((2, 0.4), (3, 0.4), (4, 0.2)):
        assert abs(counts[hops] / 20_000 - share) < 0.015


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hop_probs": (0.5, 0.5)}, "same length"),
        ({"hop_probs": (0.5, 0.4, 0.2)}, "sum to 1"),
        ({"min_seed_in_degree": 20_000}, "must not exceed"),
        ({"max_retries": 0}, ">= 1"),
    ],
)
def test_bad_sampling_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)
