"""GroupScorer: groups judged concurrently on a bounded pool, verdicts cached by judge version,
question and answer, outages left unscored (and never cached), per-step judge metrics."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from osvl.rl.chat_client import ChatCompletionsClient, ChatJudgeConfig
from osvl.rl.judges import LLMAccuracyJudge, LLMQueryJudge, Verdict
from osvl.rl.offline_judges import ExactMatchAccuracyJudge, HeuristicQueryJudge
from osvl.rl.rewards import RewardConfig
from osvl.rl.scoring import GroupScorer, JudgeStats, VerdictCache
from osvl.rl.trajectory import FinishReason, Prompt, Step, ToolCall, ToolResult, ToolStatus, Trajectory
from osvl.serve.loopback_judge import LoopbackJudgeServer, verdict_text


def _answered(
    answer: str, question: str = "Which year did the bridge open?", truth: str = "1982", sample: int = 0
) -> Trajectory:
    call = Step(
        token_ids=[1],
        logprobs=[0.0],
        text='<think>search</think><tool_call>{"name": "text_search"}</tool_call>',
        tool_call=ToolCall("text_search", {"query": "bridge opened"}),
        tool_result=ToolResult(ToolStatus.OK, "text_search", text="It opened in 1982."),
    )
    final = Step(
        token_ids=[2], logprobs=[0.0], text=f"<think>done</think><response>{answer}</response>", response=answer
    )
    return Trajectory(
        Prompt(id="q", question=question, answer=truth),
        [call, final],
        FinishReason.RESPONSE,
        group_id=0,
        sample_index=sample,
    )


class _Slow:
    """A judge that records how many calls overlap."""

    name = "test:slow:v1"

    def __init__(self, delay: float) -> None:
        self.delay, self.active, self.peak, self.calls = delay, 0, 0, 0
        self.lock = threading.Lock()

    def judge_answer(self, prompt, response):
        with self.lock:
            self.active += 1
            self.calls += 1
            self.peak = max(self.peak, self.active)
        time.sleep(self.delay)
        with self.lock:
            self.active -= 1
        return Verdict(1.0 if response == prompt.answer else 0.0, "ok", 1, self.name)


def test_same_scores_as_the_offline_scoring_and_repeated_answers_hit_the_cache():
    scorer = GroupScorer(ExactMatchAccuracyJudge(), HeuristicQueryJudge(), RewardConfig(), max_concurrency=4)
    group = [_answered("1982", sample=i) for i in range(3)] + [_answered("1990", sample=3)]
    scored = asyncio.run(scorer.score_group(group))
    scorer.close()
    assert [t.reward.acc for t in scored] == [1.0, 1.0, 1.0, 0.0]
    assert [t.sample_index for t in scored] == [0, 1, 2, 3]
    stats = scorer.stats.take()
    assert stats.calls + stats.cache_hits == 8  # accuracy + query per trajectory
    assert stats.cache_hits >= 4  # three identical answers, four identical search processes
    assert scorer.stats.take().calls == 0  # take() starts a new count


def test_concurrency_is_bounded_by_the_pool():
    slow = _Slow(0.05)
    scorer = GroupScorer(slow, HeuristicQueryJudge(), RewardConfig(), max_concurrency=3, cache_size=0)
    group = [_answered(str(i), sample=i) for i in range(9)]
    asyncio.run(scorer.score_group(group))
    scorer.close()
    assert slow.calls == 9 and 1 <= slow.peak <= 3


def test_verdict_cache_is_bounded_and_keeps_no_unscored_verdict():
    cache = VerdictCache(2)
    cache.put(("a",), Verdict(1.0))
    cache.put(("b",), Verdict(0.0))
    cache.get(("a",))  # a is now the most recent
    cache.put(("c",), Verdict(1.0))
    assert cache.get(("b",)) is None and cache.get(("a",)) is not None
    cache.put(("d",), Verdict(None, "timeout"))
    assert cache.get(("d",)) is None


def test_an_llm_judge_outage_is_unscored_and_asked_again_next_time():
    with LoopbackJudgeServer() as judge:
        client = ChatCompletionsClient(
            ChatJudgeConfig(judge.base_url, "loopback", max_attempts=2, backoff_initial_s=0.01)
        )
        scorer = GroupScorer(LLMAccuracyJudge(client), LLMQueryJudge(client), RewardConfig(), max_concurrency=2)
        judge.outage = 503
        down = asyncio.run(scorer.score_group([_answered("1982")]))[0]
        during = scorer.stats.take()
        judge.outage = None
        up = asyncio.run(scorer.score_group([_answered("1982")]))[0]
        scorer.close()
    assert down.reward.total is None and "http_503" in down.reward.unscored_reason
    assert during.requests == 4 and during.cache_hits == 0  # 2 judges x 2 attempts, nothing cached
    assert up.reward.total is not None and up.reward.acc == 1.0


def test_stats_merge_and_metrics():
    a, b = JudgeStats(2, 1, 3, [0.1, 0.2]), JudgeStats(1, 0, 1, [0.4])
    merged = JudgeStats.merge([a, b])
    assert (merged.calls, merged.cache_hits, merged.requests) == (3, 1, 4)
    metrics = merged.metrics([_answered("1982")])
    assert metrics["judge_p50_s"] == pytest.approx(0.2) and metrics["judge_p99_s"] == pytest.approx(0.396)
    assert metrics["unscored_frac"] == 0.0
    with pytest.raises(ValueError, match="max_concurrency"):
        GroupScorer(ExactMatchAccuracyJudge(), HeuristicQueryJudge(), RewardConfig(), max_concurrency=0)


def test_the_loopback_judge_answers_osvls_prompts_like_the_offline_judges():
    client_config = ChatJudgeConfig("http://127.0.0.1:1/v1", "x")  # only the templates are used
    accuracy = LLMAccuracyJudge(ChatCompletionsClient(client_config))
    prompt = Prompt(id="q", question="Which year?", answer="1982", aliases=["MCMLXXXII"])
    right = accuracy.template.substitute(question=prompt.question, references="- 1982\n- MCMLXXXII", response="1982.")
    wrong = accuracy.template.substitute(question=prompt.question, references="- 1982", response="1990")
    assert verdict_text(right).endswith("verdict: correct")
    assert verdict_text(wrong).endswith("verdict: incorrect")
    assert verdict_text("hello") is None
    with LoopbackJudgeServer() as judge:
        client = ChatCompletionsClient(ChatJudgeConfig(judge.base_url, "loopback", max_attempts=1))
        assert LLMAccuracyJudge(client).judge_answer(prompt, "MCMLXXXII").score == 1.0
        query = LLMQueryJudge(client).judge_queries(prompt, _answered("1982").steps)
        assert query.scored and 0.0 < query.score <= 1.0
        judge.outage, judge.outage_match = 429, "Which year?"
        assert not LLMAccuracyJudge(client).judge_answer(prompt, "1982").scored
        other = Prompt(id="r", question="Who built it?", answer="Telford")
        assert LLMAccuracyJudge(client).judge_answer(other, "Telford").score == 1.0  # the outage matches one question


def test_take_stats_counts_each_call_once_while_judging_goes_on():
    trajectories = [_answered("1982", question=f"Which year? ({i})", sample=i) for i in range(40)]

    def scorer():
        return GroupScorer(
            ExactMatchAccuracyJudge(), HeuristicQueryJudge(), RewardConfig(), max_concurrency=4, cache_size=0
        )

    alone = scorer()
    asyncio.run(alone.score_group(trajectories))
    expected = alone.take_stats()
    alone.close()
    busy, taken, stop = scorer(), [], threading.Event()

    def take_while_scoring():
        while not stop.is_set():
            taken.append(busy.take_stats())

    thread = threading.Thread(target=take_while_scoring)
    thread.start()
    asyncio.run(busy.score_group(trajectories))
    stop.set()
    thread.join()
    taken.append(busy.take_stats())
    busy.close()
    assert expected.calls > 0
    assert sum(s.calls for s in taken) == sum(len(s.latencies_s) for s in taken) == expected.calls
