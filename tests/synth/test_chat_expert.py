"""The chat-model expert and closed-book solver against a loopback OpenAI-compatible server that
plays a scripted expert, with the real tool environment executing the calls."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest

from osvl.rl.chat_client import ChatCompletionsClient, ChatJudgeConfig
from osvl.rl.offline_judges import ExactMatchAccuracyJudge, HeuristicQueryJudge
from osvl.rl.trajectory import FinishReason, ToolStatus, append_jsonl, read_jsonl
from osvl.synth.chat_expert import ChatExpert, ChatExpertConfig
from osvl.synth.expert import SynthesisReport, WorldTools, synthesize
from osvl.synth.filtering import CachedSolver, SolverAnswer
from osvl.synth.pipeline import CurationConfig, curate, question_image
from osvl.synth.records import QAItem, read_items
from osvl.synth.tool_solvers import ChatClosedBookSolver, SolverUnavailable
from osvl.tools import tool_schemas

from .chat_server import LoopbackChat


def _client(server: LoopbackChat, max_attempts: int = 2) -> ChatCompletionsClient:
    return ChatCompletionsClient(
        ChatJudgeConfig(server.base_url, "expert", max_attempts=max_attempts, timeout_s=10), sleep=lambda _: None
    )


def _call(name: str, **arguments) -> str:
    call = json.dumps({"name": name, "arguments": arguments})
    return f"<think>Next I use {name}.</think>\n<tool_call>{call}</tool_call>"


def _answer(text: str) -> str:
    return f"<think>The chain is complete.</think>\n<response>{text}</response>"


def expert_script(world, item: QAItem) -> list[str]:
    """What a competent expert says on ``item``: reverse-search the image, one search per hop,
    then the answer (the loopback plays it back turn by turn)."""
    titles = [world.graph[node].title for node in item.path]
    hops = [_call("text_search", query=f"{title} {relation}") for title, relation in zip(titles, item.relations)]
    return [
        _call("image_search", image=0, top_k=1),
        *hops,
        _call("text_search", query=f"{titles[-1]} {item.attribute}"),
        _answer(item.answer),
    ]


class Replay:
    """Serves one canned turn per request; ``(status, text)`` entries fail the request."""

    def __init__(self) -> None:
        self.turns: list[str | tuple[int, str]] = []

    def __call__(self, prompt: str) -> tuple[int, str]:
        turn = self.turns.pop(0)
        return turn if isinstance(turn, tuple) else (200, turn)


@pytest.fixture(scope="module")
def replay():
    script = Replay()
    with LoopbackChat(script) as server:
        yield script, server


@pytest.fixture(scope="module")
def clean_items(curated):
    out, _ = curated
    return [i for i in read_items(out / "items.jsonl") if i.degradation is None]


def _synthesize(expert, world, out, item, report):
    return synthesize(
        item,
        question_image(world, out, item),
        expert,
        1,
        random.Random(0),
        ExactMatchAccuracyJudge(),
        HeuristicQueryJudge(),
        0.97,
        report,
        0,
    )


def test_chat_expert_drives_the_real_tools_and_passes_the_judges(
    world, curated, clean_items, real_tools, replay, tmp_path
):
    out, _ = curated
    script, server = replay
    expert = ChatExpert(_client(server), real_tools, tool_schemas())
    report, kept = SynthesisReport(), []
    for item in clean_items[:2]:
        script.turns = expert_script(world, item)
        first_request = len(server.bodies)
        kept += _synthesize(expert, world, out, item, report)
        assert not script.turns  # every scripted turn was asked for
        opening = server.bodies[first_request]["messages"]
        assert opening[0]["role"] == "system" and '"name": "text_search"' in opening[0]["content"]
        assert opening[1]["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
        anchor = world.graph[item.path[0]].title
        # the real ImageSearch observation went back to the model as the next user turn
        assert server.prompts[first_request + 1].startswith(f"<tool_response>\n[Match 1] {anchor} (page: ")
    assert report.kept == 2 and report.incomplete == report.rejected_answer == 0
    trajectory = kept[0]
    assert trajectory.finish_reason is FinishReason.RESPONSE and trajectory.steps[-1].response == clean_items[0].answer
    assert all(s.tool_result.ok and s.token_ids == [] for s in trajectory.steps[:-1])
    assert "URL: world://" in trajectory.steps[1].observation_text
    append_jsonl(tmp_path / "sft.jsonl", kept)
    again = list(read_jsonl(tmp_path / "sft.jsonl"))
    assert [s.text for s in again[1].steps] == [s.text for s in kept[1].steps]


def test_expert_failures_are_counted_never_raised(world, curated, clean_items, real_tools, replay):
    out, _ = curated
    script, server = replay
    item = clean_items[0]
    expert = ChatExpert(_client(server), real_tools, tool_schemas())
    report = SynthesisReport()
    # 5xx past the retry budget: the episode ends as an infra error, nothing is written
    script.turns = [(500, "overloaded"), (503, "overloaded")]
    episode = expert.episode(item.text, question_image(world, out, item))
    assert episode.finish is FinishReason.INFRA_ERROR and episode.error == "http_503" and episode.steps == []
    script.turns = [(500, "overloaded"), (502, "overloaded")]
    assert _synthesize(expert, world, out, item, report) == [] and report.incomplete == 1
    # a transient 5xx is retried by the client and the episode goes on
    script.turns = [(503, "busy"), *expert_script(world, item)]
    assert len(_synthesize(expert, world, out, item, report)) == 1
    # malformed turns become parse errors the model sees; the process judge rejects the messy run
    script.turns = [
        "I think it is a museum.",
        '<tool_call>{"name": "text_search", "arguments": {</tool_call>',
        *expert_script(world, item),
    ]
    episode = expert.episode(item.text, question_image(world, out, item))
    assert [s.status for s in episode.steps[:2]] == [ToolStatus.PARSE_ERROR] * 2
    assert episode.finish is FinishReason.RESPONSE
    assert server.prompts[-len(episode.steps) + 1].startswith("<tool_response>\nError (parse_error): no action")
    # numbers no tool can take are the model's invalid arguments, not a crash of the episode
    script.turns = [
        '<tool_call>{"name": "text_search", "arguments": {"query": "x", "top_k": 1' + "0" * 4400 + "}}</tool_call>",
        '<tool_call>{"name": "sharpen", "arguments": {"image": 0, "amount": NaN}}</tool_call>',
        *expert_script(world, item),
    ]
    episode = expert.episode(item.text, question_image(world, out, item))
    assert [s.status for s in episode.steps[:2]] == [ToolStatus.INVALID_ARGUMENTS] * 2
    assert "'top_k' is an integer of 4401 digits" in episode.steps[0].tool_result.error
    assert episode.finish is FinishReason.RESPONSE
    script.turns = ["no tags at all", *expert_script(world, item)]
    assert _synthesize(expert, world, out, item, report) == [] and report.rejected_process == 1
    # a cascade of K=3 tool errors is fatal: the episode stops without asking for a fourth turn
    script.turns = [_call("image_search", image=5)] * 3 + [_answer(item.answer)]
    episode = expert.episode(item.text, question_image(world, out, item))
    assert episode.finish is FinishReason.FATAL and len(episode.steps) == 3 and len(script.turns) == 1
    assert all(s.status is ToolStatus.TOOL_ERROR for s in episode.steps)
    # the turn budget, and a wrong answer
    short = ChatExpert(_client(server), real_tools, tool_schemas(), ChatExpertConfig(max_turns=2))
    script.turns = expert_script(world, item)
    assert short.episode(item.text, question_image(world, out, item)).finish is FinishReason.MAX_TURNS
    script.turns = [*expert_script(world, item)[:-1], _answer("Atlantis")]
    assert _synthesize(expert, world, out, item, report) == [] and report.rejected_answer == 1
    assert report.rollouts == 4 and report.kept == 1 and report.incomplete == 1
    with pytest.raises(ValueError, match="max_turns"):
        ChatExpertConfig(max_turns=0)


def test_chat_closed_book_solver(clean_items, replay):
    script, server = replay
    item = clean_items[0]
    image = np.full((16, 16, 3), 90, np.uint8)
    solver = ChatClosedBookSolver(_client(server), image=lambda _: image)
    script.turns = [f'```json\n{{"answer": "{item.answer}"}}\n```']
    assert solver.solve(item).answer == item.answer
    content = server.bodies[-1]["messages"][0]["content"]
    assert item.text in content[0]["text"] and content[1]["type"] == "image_url"
    script.turns = ['{"answer": null}', '{"answer": "Unknown"}', "no json"]
    assert [solver.solve(item).answer for _ in range(3)] == [None, None, None]
    assert solver.name == "chat_closed_book:expert:v1"
    # an outage is not a verdict: it raises through the cache, which records nothing, and a rerun resumes
    cached = CachedSolver(ChatClosedBookSolver(_client(server)))
    script.turns = [(500, ""), (500, "")]
    with pytest.raises(SolverUnavailable, match="http_500"):
        cached.solve(item)
    script.turns = ['{"answer": "1066"}']
    assert cached.solve(item).answer == "1066" and cached.solve(item).answer == "1066" and not script.turns
    assert isinstance(server.bodies[-1]["messages"][0]["content"], str)  # no image: text only


def test_curate_takes_an_injected_expert(world, curated, replay, tmp_path):
    """Resume a finished curation with only synthesis redone, by a chat expert over exact tools."""
    source, counts = curated
    out = tmp_path / "curated"
    shutil.copytree(source, out)
    for stale in ("synthesis.json", "curation.json"):
        (out / stale).unlink()
    script, server = replay
    items = {i.text: i for i in read_items(out / "items.jsonl")}

    def play(prompt: str) -> tuple[int, str]:  # answers any item: the first turn names it
        if not play.turns:
            play.turns = expert_script(world, items[prompt])
        return 200, play.turns.pop(0)

    play.turns = []
    server.reply = play
    config = CurationConfig(rollouts_per_item=1, rl_fraction=0.97)
    try:
        result = curate(
            world,
            out,
            config,
            expert=ChatExpert(_client(server), WorldTools(world), tool_schemas(), ChatExpertConfig(send_images=False)),
        )
    finally:
        server.reply = script
    synthesis = result["synthesize"]
    assert result["single_image_search"] == counts["single_image_search"]  # earlier stages resumed, not redone
    assert synthesis["rollouts"] == synthesis["sft_items"] >= 1 and synthesis["incomplete"] == 0
    written = list(read_jsonl(out / "sft" / "trajectories.jsonl"))
    assert len(written) == synthesis["kept"] >= 1
    assert all(t.steps[0].tool_call.arguments == {"image": 0, "top_k": 1} for t in written)
    with pytest.raises(ValueError, match="expert_tools"):
        CurationConfig(expert_tools="web")


def test_curate_uses_injected_filter_solvers(world, curated, tmp_path):
    """Redo stage 1 with a solver that never answers: the items it used to drop flow on to the
    injected stage-2 solver, everything decided before is resumed."""
    source, counts = curated
    out = tmp_path / "curated"
    shutil.copytree(source, out)
    for stale in ("no_tools.jsonl", "no_tools.jsonl.drops.jsonl", "curation.json"):
        (out / stale).unlink()

    class Recording:
        def __init__(self, name: str) -> None:
            self.name, self.seen = name, []

        def solve(self, item):
            self.seen.append(item.id)
            return SolverAnswer(None, 0)

    closed_book, image_search = Recording("never_closed_book"), Recording("never_image_search")
    result = curate(world, out, CurationConfig(), closed_book=closed_book, image_search=image_search)
    assert len(closed_book.seen) == counts["ground"]["kept"] and result["no_tools"]["dropped"] == {}
    formerly_easy = counts["no_tools"]["dropped"]["answerable_without_tools"]
    assert len(image_search.seen) == formerly_easy >= 1  # only the newly kept items reach stage 2
    assert result["single_image_search"]["in"] == counts["single_image_search"]["in"] + formerly_easy
