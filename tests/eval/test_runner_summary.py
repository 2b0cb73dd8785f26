"""Resume semantics, concurrency, unjudged exclusion and the paper-layout table, with a scripted answerer."""

from __future__ import annotations

import asyncio

import pytest

from osvl.eval.items import EvalItem
from osvl.eval.modes import Attempt, extract_answer
from osvl.eval.runner import EvalRunConfig, Evaluator, read_records
from osvl.eval.summary import cost_table, paper_table, pass_table, summarize_benchmark
from osvl.rl.judges import Verdict
from osvl.rl.trajectory import FinishReason, Step, Trajectory

ITEMS = [EvalItem("simplevqa", str(i), f"Q{i}?", (f"a{i}",)) for i in range(6)]


class ScriptedAnswerer:
    """Answers right for even ids; ``broken`` ids fail as engine infra errors."""

    mode = "agentic"

    def __init__(self, broken=()) -> None:
        self.broken, self.calls, self.in_flight, self.peak = set(broken), [], 0, 0

    async def attempt(self, prompt, seed):
        self.calls.append(prompt.id)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        if prompt.id.split("/")[1] in self.broken:
            return Attempt(Trajectory(prompt, [], FinishReason.INFRA_ERROR, 0, 0), None, 0, 0, 10)
        i = int(prompt.id.split("/")[1])
        answer = prompt.answer if i % 2 == 0 else "wrong"
        step = Step(token_ids=[1, 2], logprobs=[-0.1, -0.2], response=answer)
        return Attempt(Trajectory(prompt, [step], FinishReason.RESPONSE, 0, 0), answer, 1, 2, 12)


class FlakyJudge:
    name = "test:flaky"

    def __init__(self, down=()) -> None:
        self.down, self.calls = set(down), []

    def judge(self, item, answer):
        self.calls.append(item.id)
        if item.id in self.down:
            return Verdict(None, "http_503", 5, self.name)
        return Verdict(float(answer == item.answers[0]), "", 1, self.name)


def _run(tmp_path, answerer, judge, concurrency=2):
    return asyncio.run(Evaluator(answerer, judge, tmp_path, EvalRunConfig(concurrency=concurrency)).run(ITEMS))


def test_unjudged_items_are_excluded_then_rejudged_without_regenerating(tmp_path):
    answerer = ScriptedAnswerer(broken={"5"})
    stats = _run(tmp_path, answerer, FlakyJudge(down={"0", "1"}))
    assert stats.generated == 6 and answerer.peak == 2
    records, _ = read_records(tmp_path / "records.jsonl")
    s = summarize_benchmark("simplevqa", "SimpleVQA", list(records.values()), rejected_at_load=3)
    # judged: 2 (right), 3 (wrong), 4 (right); 0 and 1 unjudged; 5 infra error
    assert (s.judged, s.correct, s.unjudged, s.infra_error) == (3, 2.0, 2, 1)
    assert s.pass_at_1 == pytest.approx(200 / 3) and s.unjudged_reasons == {"http_503": 2}
    assert s.tool_calls_per_item == 1.0 and s.context_tokens_per_item == 12.0 and s.judge_requests == 13

    answerer2, judge2 = ScriptedAnswerer(), FlakyJudge()
    stats = _run(tmp_path, answerer2, judge2)
    assert answerer2.calls == ["simplevqa/5"]  # only the infra error is regenerated
    assert sorted(judge2.calls) == ["0", "1", "5"] and (stats.rejudged, stats.skipped) == (2, 3)
    records, _ = read_records(tmp_path / "records.jsonl")
    s = summarize_benchmark("simplevqa", "SimpleVQA", list(records.values()))
    assert (s.judged, s.correct, s.unjudged, s.infra_error) == (6, 3.0, 0, 0) and s.pass_at_1 == 50.0


def test_a_torn_last_line_is_counted_and_the_item_redone(tmp_path):
    _run(tmp_path, ScriptedAnswerer(), FlakyJudge())
    with open(tmp_path / "records.jsonl", "a") as handle:
        handle.write('{"benchmark": "simplevqa", "id": "0", "sta')
    answerer = ScriptedAnswerer()
    stats = _run(tmp_path, answerer, FlakyJudge())
    assert stats.corrupt_lines == 1 and stats.skipped == 6 and answerer.calls == []


def test_bad_images_are_recorded_as_bad_input(tmp_path):
    item = EvalItem("fvqa", "x", "Q?", ("a",), images=(str(tmp_path / "gone.png"),))
    asyncio.run(Evaluator(ScriptedAnswerer(), FlakyJudge(), tmp_path).run([item]))
    [record] = read_records(tmp_path / "records.jsonl")[0].values()
    assert record["status"] == "bad_input" and "image file not found" in record["error"]
    assert summarize_benchmark("fvqa", "FVQA", [record]).pass_at_1 is None


def test_duplicate_keys_and_bad_config_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="unique"):
        asyncio.run(Evaluator(ScriptedAnswerer(), FlakyJudge(), tmp_path).run(ITEMS[:1] * 2))
    with pytest.raises(ValueError, match="concurrency"):
        EvalRunConfig(concurrency=0)


def test_paper_numbers_sit_beside_ours_and_are_labelled():
    table = paper_table()
    assert table["columns"] == ["SimpleVQA", "VDR", "MMSearch", "LiveVQA", "BrowseComp-VL", "FVQA", "InfoSeek"]
    ours = next(r for r in table["rows"]["agentic"] if r["model"].startswith("OpenSearch-VL-30B"))
    assert ours["scores"]["VDR"] == 33.5 and ours["avg"] == 61.6
    for row in table["rows"]["direct"] + table["rows"]["rag"]:
        assert row["avg"] == pytest.approx(sum(row["scores"].values()) / 7, abs=0.06)

    records = [
        {
            "status": "judged",
            "verdict": {"score": s, "attempts": 0},
            "tool_calls": 0,
            "generated_tokens": 1,
            "context_tokens": 2,
            "latency_s": 0.1,
            "judge_latency_s": 0.0,
        }
        for s in (1.0, 0.0)
    ]
    summaries = [
        summarize_benchmark("infoseek", "InfoSeek", records),
        summarize_benchmark("simplevqa", "SimpleVQA", records[:1]),
        summarize_benchmark("world", None, records),
    ]
    text = pass_table(summaries, "rag", "osvl (rag)")
    lines = text.splitlines()
    assert lines[0] == "| Model | SimpleVQA | InfoSeek | world | Avg |"
    assert lines[2] == "| **osvl (rag)** | 100.0 | 50.0 | 50.0 | 66.7 |"
    assert "| paper: GPT-4o (Team, 2024) | 63.6 | 59.5 | – | 61.5† |" in lines
    assert "not results of this run" in text and "RAG Workflow" in text
    assert sum(line.startswith("| paper:") for line in lines) == len(table["rows"]["rag"])
    assert "| world | 2 | 2 | 1 | 0 |" in cost_table(summaries)
    for markdown in (cost_table(summaries), text):
        rows = [line for line in markdown.splitlines() if line.startswith("|")]
        widths = {len(line.strip("|").split("|")) for line in rows}
        assert len(widths) == 1 and set(rows[1]) == set("|-"), rows  # header, separator and rows line up


def test_full_seven_benchmark_runs_show_the_reported_average():
    records = [
        {
            "status": "judged",
            "verdict": {"score": 1.0},
            "tool_calls": 0,
            "generated_tokens": 1,
            "context_tokens": 2,
            "latency_s": 0.1,
            "judge_latency_s": 0.0,
        }
    ]
    summaries = [summarize_benchmark(c.lower(), c, records) for c in paper_table()["columns"]]
    text = pass_table(summaries, "agentic", "osvl")
    assert "| paper: OpenSearch-VL-32B(Ours) | 76.2 | 33.8 | 72.3 | 70.5 | 43.8 | 74.7 | 74.8 | 63.7 |" in text
    assert "| paper: WebWatcher-32B Geng et al. (2025) | 59.0 | – | 55.3 | 58.7 | 27.0 | – | – | – |" in text
    assert "†" not in text


@pytest.mark.parametrize(
    "text, answer",
    [
        ("<think>hm</think>\n<response> Oslo </response>", "Oslo"),
        ("<think>hm</think> Oslo", "Oslo"),
        ("<think>never closed", None),
        ("", None),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_progress_lines_say_how_far_the_run_is_and_its_running_accuracy(tmp_path, capsys):
    config = EvalRunConfig(concurrency=2, progress_every_s=1e-9)  # a line after every record
    asyncio.run(Evaluator(ScriptedAnswerer(broken={"5"}), FlakyJudge(down={"4"}), tmp_path, config).run(ITEMS))
    # its own lines only: a server thread another test left in this worker may print a traceback meanwhile
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("osvl.eval: ")]
    assert len(lines) == len(ITEMS) + 1  # one per record, then the final one
    assert lines[-1].startswith("osvl.eval: 6/6 items (0 judged before), running accuracy 0.500 over 4 judged; ")
    assert "1 unjudged, 1 infra errors, 0 bad inputs" in lines[-1]  # ids 0 and 2 right of 0-3; 4 unjudged; 5 broken
    assert [int(line.split()[1].split("/")[0]) for line in lines[:-1]] == list(range(1, 7))
    again = Evaluator(ScriptedAnswerer(), FlakyJudge(), tmp_path, EvalRunConfig(progress_every_s=0))
    asyncio.run(again.run(ITEMS))  # resumed: rejudges 4, regenerates 5; no line at 0
    assert capsys.readouterr().err == "" and "(4 judged before)" in again.progress_line()
    with pytest.raises(ValueError, match="progress_every_s"):
        EvalRunConfig(progress_every_s=-1)
