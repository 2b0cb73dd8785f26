"""``osvl.demo evaluate``: greedy Pass@1 under the GRPO stage's prompt and world tools."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest

from osvl.config import load_recipe
from osvl.demo import main, phase_lines, seed_lines, summary_lines
from osvl.rl.trajectory import FinishReason, Prompt, Step, Trajectory, read_jsonl, write_prompts
from osvl.rollout import ReplayEngine
from osvl.trainer.evaluation import chain_breaks, evaluate_policy, prompt_lookups
from osvl.trainer.validation import answer_is_grounded
from osvl.world.__main__ import main as world_main
from osvl.world.build import load_world
from tests.fresh_imports import fresh_imports
from tests.rl.helpers import ZOO_QUESTION, tool_step, zoo_chain_steps
from tests.trainer.fixtures import write_sft_data
from tests.trainer.test_report import fake_run


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo_eval")
    assert world_main(["build", "--out", str(root / "world"), "--seed", "0"]) == 0
    tok, _ = write_sft_data(root / "data")
    prompts = [  # q0 and q1 say where they start and how many hops they take, as drills do
        Prompt(id=f"q{i}", question=f"Which city is number {i}?", answer=answer, anchor=anchor, hops=hops)
        for i, (answer, anchor, hops) in enumerate(
            [("Wenmilun", "Wenmilun", 1), ("Fenulhal", "Wenmilun", 2), ("Ulpelsal", "", 0), ("Danarfen", "", 0)]
        )
    ]
    write_prompts(root / "prompts.jsonl", prompts)
    overrides = [
        f"data.tokenizer={tok}",
        f"data.train_path={root / 'prompts.jsonl'}",
        "model.pretrained=",
        f"tools.world_dir={root / 'world'}",
        "tools.workers=1",
        "tools.fault_rate=0.5",
        "grpo.max_response_tokens=64",
        "rollout.max_turns=2",
    ]
    return load_recipe("tiny_grpo", overrides), prompts


def answering(correct: set[str]):
    """Answers the questions whose number is in ``correct`` right, the others wrong, after one
    search for the right answer's page (so the right answers are stated by the observation)."""

    def wrap(local):
        tok = local.tokenizer

        def script(request):
            text = tok.decode(request.input_ids, skip_special_tokens=False)
            number = text.split("number ")[1].split("?")[0]
            name = ["Wenmilun", "Fenulhal", "Ulpelsal", "Danarfen"][int(number)]
            if "</tool_call>" not in text:
                call = json.dumps({"name": "text_search", "arguments": {"query": name}})
                out = f"<think>look</think>\n<tool_call>{call}</tool_call>"
            else:
                answer = name if number in correct else "nowhere"
                out = f"<think>done</think>\n<response>{answer}</response>"
            return tok.encode(out) + [tok.special.im_end]

        return ReplayEngine(local, script)

    return wrap


def test_accuracy_counts_right_answers_and_faults_are_off(setup, tmp_path):
    recipe, prompts = setup
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text("a stale line that the evaluation replaces\n")
    result = evaluate_policy(recipe, "init", engine_wrapper=answering({"0", "2", "3"}), rollouts=rollouts)
    written = list(read_jsonl(rollouts))
    assert {t.prompt.id: t.reward.acc for t in written} == result["per_prompt"] == {"q0": 1, "q1": 0, "q2": 1, "q3": 1}
    assert all(t.steps[0].tool_call.name == "text_search" and t.final_answer for t in written)
    assert result["chains"] == {"rollouts": 0, "complete": 0, "broken_at": {}}  # no question of the chain form
    assert result["lookups"] == {}
    assert result["anchors"] == {"q0": "Wenmilun", "q1": "Wenmilun"} and result["hops"] == {"q0": 1, "q1": 2}
    with pytest.raises(ValueError, match="is a directory"):
        evaluate_policy(recipe, "init", engine_wrapper=answering(set()), rollouts=tmp_path)
    assert result["prompts"] == result["scored"] == len(prompts)
    assert result["accuracy"] == pytest.approx(0.75) and result["answered"] == 1.0
    assert result["grounded"] == pytest.approx(0.75)  # the wrong answer is stated by no observation
    assert result["turns_mean"] == 2.0 and result["fatal_rate"] == 0.0
    assert result["tool_statuses"] == {"ok": 4}  # tools.fault_rate=0.5 in the recipe is switched off
    assert result["tool_faults"] == {"fault_rate": 0.0, "outage_rate": 0.0}


def test_evaluation_with_faults_strikes_the_same_calls_for_every_checkpoint(setup, tmp_path):
    recipe, _ = setup
    first = evaluate_policy(recipe, "init", engine_wrapper=answering({"0", "1", "2", "3"}), faults=True)
    again = evaluate_policy(
        recipe, "init", engine_wrapper=answering({"0", "1"}), faults=True, rollouts=tmp_path / "r.jsonl"
    )
    assert first["tool_faults"] == {"fault_rate": 0.5, "outage_rate": 0.0}
    assert first["tool_statuses"] == again["tool_statuses"]
    assert 0 < first["tool_statuses"]["tool_error"] < 4  # recipe's 0.5: some of the 4 searches fail, not all
    failed = [t for t in read_jsonl(tmp_path / "r.jsonl") if not t.steps[0].tool_result.ok]
    assert failed and all(t.steps[0].observation_text == "Error (tool_error): injected fault" for t in failed)
    # the scripted answer follows any observation: a faulted search still answers, so accuracy is as scripted
    assert first["accuracy"] == 1.0 and again["accuracy"] == 0.5


def test_sampled_evaluation_keeps_every_sample_and_reports_pass_at_k(setup):
    recipe, prompts = setup
    finals: dict[str, int] = {}

    def alternating(local):
        """q0 always right, q1 right on its first final answer only, q2 and q3 never."""
        inner = answering({"0", "1"})(local)

        def script(request):
            ids = inner.script(request)
            text = local.tokenizer.decode(request.input_ids, skip_special_tokens=False)
            number = text.split("number ")[1].split("?")[0]
            if "</tool_call>" in text and number == "1":
                finals[number] = finals.get(number, 0) + 1
                if finals[number] > 1:
                    return local.tokenizer.encode("<response>nowhere</response>") + [local.tokenizer.special.im_end]
            return ids

        return ReplayEngine(local, script)

    result = evaluate_policy(recipe, "init", engine_wrapper=alternating, samples=3)
    assert result["samples"] == 3 and result["prompts"] == len(prompts) and result["scored"] == 3 * len(prompts)
    per_prompt = {prompt: sorted(accs) for prompt, accs in result["per_prompt"].items()}  # samples finish in any order
    assert per_prompt == {"q0": [1.0] * 3, "q1": [0.0, 0.0, 1.0], "q2": [0.0] * 3, "q3": [0.0] * 3}
    assert result["pass_at_k"]["1"] == pytest.approx((1 + 1 / 3) / 4)
    assert result["pass_at_k"]["3"] == pytest.approx(0.5)  # q0 and q1 answered at least once in 3
    assert result["temperature"] == recipe.grpo.temperature
    greedy = evaluate_policy(recipe, "init", engine_wrapper=answering({"1"}))
    assert greedy["per_prompt"] == {"q0": 0.0, "q1": 1.0, "q2": 0.0, "q3": 0.0} and "pass_at_k" not in greedy
    with pytest.raises(ValueError, match="samples must be >= 0"):
        evaluate_policy(recipe, "init", samples=-1)


def test_chain_breaks_count_where_each_rollout_stopped_following_its_evidence():
    question = ZOO_QUESTION
    image, founder = zoo_chain_steps()
    occupation = tool_step("ok", arguments={"query": "Jorlo Talcor occupation"}, observation="Its occupation is x.")
    wrong = tool_step("ok", arguments={"query": "Jorlo Talcor founder"}, observation="Jorlo Talcor is a person.")

    def rollout(question, *steps):
        return Trajectory(Prompt("z", question, answer="x"), list(steps), FinishReason.RESPONSE, 0, 0)

    rollouts = [
        rollout(question, image, founder, occupation),
        rollout(question, image, founder, wrong),
        rollout(question, image, wrong, occupation),
        rollout(question, image, wrong),
        rollout("Which city is number 3?", founder),
    ]
    assert chain_breaks(prompt_lookups(rollouts)) == {"rollouts": 4, "complete": 1, "broken_at": {"1": 2, "2": 1}}
    assert chain_breaks(prompt_lookups([])) == {"rollouts": 0, "complete": 0, "broken_at": {}}
    other = dataclasses.replace(rollouts[1], prompt=Prompt("y", question, answer="x"))
    assert prompt_lookups([*rollouts, other]) == {"z": [[2, 2], [1, 2], [0, 2], [0, 2]], "y": [[1, 2]]}


def test_a_grounded_answer_is_stated_word_for_word_by_an_observation():
    def rollout(answer, *observations):
        steps = [Step([], [], observation_text=o) for o in observations]
        return Trajectory(Prompt("q", "?"), steps + [Step([], [], response=answer)], FinishReason.RESPONSE, 0, 0)

    passage = "Lovor is a city. Its population is 254000. The country of Lovor is Britorland."
    assert answer_is_grounded(rollout("254000", "[Match 1] Lovor", passage))
    assert answer_is_grounded(rollout(" Britorland ", passage))
    assert not answer_is_grounded(rollout("25400", passage))  # a piece of a stated number is not stated
    assert not answer_is_grounded(rollout("Brit", passage))
    assert not answer_is_grounded(rollout("386000", passage))
    assert not answer_is_grounded(rollout("", passage))
    no_answer = Trajectory(Prompt("q", "?"), [Step([], [], observation_text=passage)], FinishReason.MAX_TURNS, 0, 0)
    assert not answer_is_grounded(no_answer)


def test_random_init_policy_is_measured_not_assumed(setup, tmp_path):
    recipe, _ = setup
    out = tmp_path / "init.json"
    args = ["evaluate", "--recipe", "tiny_grpo", "--checkpoint", "init", "--out", str(out), "--limit", "2"]
    overrides = [
        f"{k}={v}"
        for k, v in (
            ("data.tokenizer", recipe.data.tokenizer),
            ("data.train_path", recipe.data.train_path),
            ("model.pretrained", ""),
            ("tools.world_dir", recipe.tools.world_dir),
            ("tools.workers", 1),
            ("grpo.max_response_tokens", 8),
            ("rollout.max_turns", 1),
        )
    ]
    assert main(args + [x for o in overrides for x in ("--set", o)]) == 0
    result = json.loads(out.read_text())
    assert result["checkpoint"] == "init" and result["scored"] == 2 and result["accuracy"] == 0.0


def _write_eval(path, accuracy: float, scored: int = 20, per_prompt: dict | None = None, **extra) -> Path:
    path.write_text(
        json.dumps(
            {
                "accuracy": accuracy,
                "reward": accuracy,
                "reward_fmt": 1.0,
                "answered": 1.0,
                "grounded": 0.5,
                "fatal_rate": 0.0,
                "turns_mean": 3.0,
                "scored": scored,
                **({"per_prompt": per_prompt} if per_prompt is not None else {}),
                **extra,
            }
        )
    )
    return path


def test_summary_compares_each_stage_with_the_one_before_by_prompt(tmp_path):
    sft = fake_run(tmp_path / "sft", "fatal_clamp", [0.0, 0.0])
    grpo = fake_run(tmp_path / "grpo", "fatal_clamp", [0.1, 0.3])
    prompts = [f"q{i}" for i in range(20)]
    right = {"init": set(), "sft": {"q0"}, "grpo": {"q0", "q1"}}
    evals = [
        (label, _write_eval(tmp_path / f"{label}.json", len(r) / 20, per_prompt={p: float(p in r) for p in prompts}))
        for label, r in right.items()
    ]
    lines = summary_lines(sft, grpo, 1, evals)
    assert lines[0].endswith("(GRPO's prompt, tools and turn budget; no faults):")
    assert lines[1].startswith("  init  accuracy 0.000 [0.000, 0.161]")  # Wilson 95%, 0 of 20
    assert lines[3].startswith("  grpo  accuracy 0.100 [0.028, 0.301]")  # 2 of 20
    assert lines[4].startswith("  sft - init: +0.050 [+0.000, +0.150]")  # one prompt turned right: not apart
    assert lines[5].startswith("  grpo - sft: +0.050") and "not distinguishable from sft" in lines[5]
    # 12 of 20 prompts turn right after GRPO and none turn wrong: the paired interval clears zero
    gain = {p: float(p in right["sft"] or i < 13) for i, p in enumerate(prompts)}
    evals[2] = ("grpo", _write_eval(tmp_path / "grpo.json", sum(gain.values()) / 20, per_prompt=gain))
    line = summary_lines(sft, grpo, 1, evals)[5]
    assert line.startswith("  grpo - sft: +0.600 [+0.400, +0.800]") and line.endswith("grpo is higher than sft")
    # other prompts, or evaluations without per-prompt results, are reported as not comparable
    _write_eval(tmp_path / "other.json", 0.1, per_prompt={"x": 1.0})
    assert (
        "not compared (paired evaluations need the same prompts"
        in summary_lines(sft, grpo, 1, [evals[1], ("grpo", tmp_path / "other.json")])[3]
    )
    _write_eval(tmp_path / "old.json", 0.1)
    assert (
        "no per-prompt results to pair" in summary_lines(sft, grpo, 1, [evals[1], ("grpo", tmp_path / "old.json")])[3]
    )
    curated = _write_eval(tmp_path / "curated.json", 0.0, scored=32)
    lines = summary_lines(sft, grpo, 1, evals, [("grpo", curated)])
    assert "not compared" in lines[6] and lines[7].startswith("  grpo  accuracy 0.000") and lines[7].endswith("(n=32)")
    common = ["summary", "--sft", str(sft), "--grpo", str(grpo), "--evals", f"init={curated}"]
    with pytest.raises(SystemExit):
        main(common + ["--other-evals", str(curated)])  # no LABEL=
    assert main(common + [f"grpo={curated}", "--other-evals", f"curated={curated}"]) == 0


def test_summary_names_the_faults_its_evaluations_ran_under_and_refuses_a_mix(tmp_path):
    sft = fake_run(tmp_path / "sft", "fatal_clamp", [0.0, 0.0])
    grpo = fake_run(tmp_path / "grpo", "fatal_clamp", [0.1, 0.3])
    faults = {"tool_faults": {"fault_rate": 0.1, "outage_rate": 0.0}}
    evals = [(label, _write_eval(tmp_path / f"{label}.json", 0.5, **faults)) for label in ("sft", "grpo")]
    header = summary_lines(sft, grpo, 1, evals)[0]
    assert header.endswith(
        "(GRPO's prompt, tools and turn budget; tool faults as in training: 0.1 of calls, outages 0):"
    )
    evals[0] = ("sft", _write_eval(tmp_path / "clean.json", 0.5))  # no tool_faults: an evaluation without faults
    with pytest.raises(ValueError, match="different tool faults"):
        summary_lines(sft, grpo, 1, evals)
    # --faulted: a second block, compared stage by stage, after the clean one
    prompts = [f"q{i}" for i in range(10)]
    before = _write_eval(
        tmp_path / "f_sft.json", 0.2, per_prompt={p: float(p in {"q0", "q1"}) for p in prompts}, **faults
    )
    after = _write_eval(tmp_path / "f_grpo.json", 0.9, per_prompt={p: float(p != "q9") for p in prompts}, **faults)
    clean = [("sft", tmp_path / "clean.json"), ("grpo", tmp_path / "clean.json")]
    lines = summary_lines(sft, grpo, 1, clean, faulted=[("sft", before), ("grpo", after)])
    start = next(i for i, line in enumerate(lines) if "tool faults as in training: 0.1" in line)
    assert start > 0 and lines[0].endswith("no faults):")
    assert lines[start + 1].split()[:3] == ["sft", "accuracy", "0.200"]
    assert lines[start + 2].split()[:3] == ["grpo", "accuracy", "0.900"]
    assert lines[start + 3].startswith("  grpo - sft: +0.700") and lines[start + 3].endswith("grpo is higher than sft")
    argv = ["summary", "--sft", str(sft), "--grpo", str(grpo), "--faulted", f"sft={before}", f"grpo={after}"]
    assert main(argv) == 0


def test_summary_says_where_each_stage_stopped_following_its_evidence(tmp_path):
    sft = fake_run(tmp_path / "sft", "fatal_clamp", [0.0, 0.0])
    grpo = fake_run(tmp_path / "grpo", "fatal_clamp", [0.1, 0.3])
    chains = {"rollouts": 20, "complete": 12, "broken_at": {"1": 6, "2": 2}}
    evals = [
        ("sft", _write_eval(tmp_path / "sft.json", 0.5, chains=chains)),
        ("grpo", _write_eval(tmp_path / "grpo.json", 0.5, chains={"rollouts": 20, "complete": 20, "broken_at": {}})),
    ]
    lines = summary_lines(sft, grpo, 1, evals)
    expected = "  sft   followed its evidence through every lookup in 12/20 rollouts; first lookup missed: "
    assert expected + "lookup 1: 6, lookup 2: 2" in lines
    assert "  grpo  followed its evidence through every lookup in 20/20 rollouts; first lookup missed: none" in lines
    no_chains = _write_eval(tmp_path / "plain.json", 0.5, chains={"rollouts": 0, "complete": 0, "broken_at": {}})
    assert not any("followed its evidence" in line for line in summary_lines(sft, grpo, 1, [("sft", no_chains)]))


def test_summary_reports_pass_at_k_of_sampled_evaluations(tmp_path, capsys):
    sft = fake_run(tmp_path / "sft", "fatal_clamp", [0.0, 0.0])
    grpo = fake_run(tmp_path / "grpo", "fatal_clamp", [0.1, 0.3])
    sampled = []
    for label, passes in (("sft", {"1": 0.25, "2": 0.4}), ("grpo", {"1": 0.5, "2": 0.55})):
        path = _write_eval(
            tmp_path / f"{label}_k.json",
            passes["1"],
            samples=2,
            prompts=8,
            pass_at_k=passes,
            temperature=0.7,
            top_p=1.0,
        )
        sampled.append((label, path))
    lines = summary_lines(sft, grpo, 1, sampled=sampled)
    assert lines[0].startswith("pass@k:")
    assert lines[1] == "  sft   pass@1 0.250  pass@2 0.400  (n=8 prompts x 2 samples at temperature 0.7, top-p 1)"
    assert lines[2].startswith("  grpo  pass@1 0.500  pass@2 0.550")
    assert main(["summary", "--sft", str(sft), "--grpo", str(grpo), "--sampled", f"sft={sampled[0][1]}"]) == 0
    assert "pass@2 0.400" in capsys.readouterr().out


def test_summary_says_how_many_greedy_misses_a_sample_answers(tmp_path):
    sft = fake_run(tmp_path / "sft", "fatal_clamp", [0.0, 0.0])
    grpo = fake_run(tmp_path / "grpo", "fatal_clamp", [0.1, 0.3])
    greedy = {"q0": 0.0, "q1": 0.0, "q2": 1.0, "q3": 1.0}
    evals = [("sft", _write_eval(tmp_path / "sft.json", 0.5, scored=4, per_prompt=greedy))]
    per_prompt = {"q0": [0.0, 1.0], "q1": [0.0, 0.0], "q2": [0.0, 0.0], "q3": [1.0, 0.0]}
    extra = {"samples": 2, "prompts": 4, "pass_at_k": {"1": 0.25, "2": 0.5}, "temperature": 0.7, "top_p": 1.0}
    sampled = [
        ("sft", _write_eval(tmp_path / "sft_k.json", 0.25, scored=8, per_prompt=per_prompt, **extra)),
        ("grpo", _write_eval(tmp_path / "grpo_k.json", 0.25, scored=8, per_prompt=per_prompt, **extra)),
    ]
    lines = summary_lines(sft, grpo, 1, evals, sampled=sampled)
    start = lines.index("room for sharpening: greedy misses that a sample answers, per stage:")
    assert lines[start + 1] == (
        "  sft   greedy misses 2/4, 1 of them answered by at least one of its 2 samples; 1 of its 2 greedy answers "
        "given by fewer than half"
    )
    assert not any(line.startswith("  grpo  greedy misses") for line in lines)  # no greedy grpo evaluation to pair
    assert not any(line.startswith("room for") for line in summary_lines(sft, grpo, 1, sampled=sampled))


def test_tokenizer_learns_the_data_and_the_first_text_documents(tmp_path):
    import shutil

    from osvl.data.tokenizer import load_tokenizer
    from osvl.demo import demo_tokenizer

    data = tmp_path / "data"
    shutil.copytree(write_sft_data(tmp_path / "fixture")[1].parent, data / "sft")  # trajectories and their images
    (data / "sft" / "sft.jsonl").rename(data / "sft" / "trajectories.jsonl")
    write_prompts(data / "rl" / "prompts.jsonl", [Prompt(id="q", question="Which bridge opened first?", answer="x")])
    text = tmp_path / "text.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"{word} " * 50}) for word in ("Zorblaxquint", "Mervantolyq")))
    plain = load_tokenizer(demo_tokenizer(data, 320))
    assert (data / "tokenizer.json").is_file()
    first = load_tokenizer(demo_tokenizer(data, 320, text, text_docs=1, out=tmp_path / "first.json"))
    both = load_tokenizer(demo_tokenizer(data, 320, text, out=tmp_path / "both.json"))
    assert len(first.encode("Zorblaxquint")) < len(plain.encode("Zorblaxquint"))
    assert len(both.encode("Mervantolyq")) < min(len(first.encode("Mervantolyq")), len(plain.encode("Mervantolyq")))
    assert len(first.encode("Mervantolyq")) > 2  # document 2 was left out: its word stays in pieces
    with pytest.raises(ValueError, match="text_docs must be >= 0"):
        demo_tokenizer(data, 320, text, text_docs=-1)
    assert (
        main(
            [
                "tokenizer",
                "--data",
                str(data),
                "--vocab-size",
                "320",
                "--max-digits",
                "2",
                "--out",
                str(tmp_path / "paired.json"),
            ]
        )
        == 0
    )
    paired = load_tokenizer(tmp_path / "paired.json")
    assert [paired.decode([i]) for i in paired.encode("1937")] == ["19", "37"]
    assert len(plain.encode("1937")) == 4
    with pytest.raises(ValueError, match="is missing"):
        demo_tokenizer(tmp_path / "nowhere", 320)
    assert world_main(["build", "--out", str(tmp_path / "world"), "--seed", "3"]) == 0
    args = ["tokenizer", "--data", str(data), "--vocab-size", "320", "--out", str(tmp_path / "names.json")]
    assert main([*args, "--entity-world", str(tmp_path / "world")]) == 0
    names = load_tokenizer(tmp_path / "names.json")
    titles = [page.title for page in load_world(tmp_path / "world").graph.entities()]
    assert all(len(names.encode(title)) == 1 for title in titles)  # every entity name is one id
    assert names.vocab_size == plain.vocab_size + len(set(titles))


def test_answer_prior_guesses_the_most_frequent_answer_to_the_asked_attribute(tmp_path):
    from osvl.demo import answer_prior
    from osvl.rl.trajectory import FinishReason, Trajectory, append_jsonl

    def traj(question, answer):
        return Trajectory(
            prompt=Prompt(id=question + answer, question=question, answer=answer),
            steps=[],
            finish_reason=FinishReason.RESPONSE,
            group_id=0,
            sample_index=0,
        )

    sft = tmp_path / "sft.jsonl"
    append_jsonl(
        sft,
        [
            traj("What is the area in km2 of the country of Ul?", "386000"),
            traj("What is the area in km2 of the country of Ka?", "386000"),
            traj("What is the area in km2 of Dracorland?", "543000"),
            traj("In what year is the birth date of the mayor of Lo?", "1901"),
            traj("Which bridge is older?", "Tal Bridge"),
            traj("Which bridge is taller?", "Tal Bridge"),
            traj("Which bridge is longer?", "Tal Bridge"),
        ],
    )
    prompts = [
        Prompt(
            id="a", question="What is the area in km2 of the country of the city shown in the image?", answer="386000"
        ),
        Prompt(id="b", question="What is the area in km2 of Issalland?", answer="793000"),
        Prompt(id="c", question="In what year is the birth date of the parent of Mi?", answer="1901"),
        Prompt(id="d", question="What is the style of the tower shown in the image?", answer="Tal bridge"),
    ]
    assert answer_prior(sft, prompts) == {"accuracy": 0.75, "prompts": 4}  # d: no such attribute -> overall mode
    assert answer_prior(sft, prompts[1:2])["accuracy"] == 0.0
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no trajectories"):
        answer_prior(tmp_path / "empty.jsonl", prompts)
    (tmp_path / "bad.jsonl").write_text(sft.read_text() + '{"steps": []}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:8: not a trajectory record"):
        answer_prior(tmp_path / "bad.jsonl", prompts)
    write_prompts(tmp_path / "rl" / "prompts.jsonl", prompts)
    out = tmp_path / "prior_cli.json"
    assert (
        main(
            [
                "prior",
                "--recipe",
                "tiny_grpo",
                "--sft",
                str(sft),
                "--out",
                str(out),
                "--limit",
                "3",
                "--set",
                f"data.train_path={tmp_path / 'rl' / 'prompts.jsonl'}",
            ]
        )
        == 0
    )
    assert json.loads(out.read_text()) == {"accuracy": 2 / 3, "prompts": 3}
    prior = tmp_path / "prior.json"
    prior.write_text(json.dumps({"accuracy": 0.2, "prompts": 4}))
    sft_run = fake_run(tmp_path / "sft", "fatal_clamp", [0.0, 0.0])
    grpo_run = fake_run(tmp_path / "grpo", "fatal_clamp", [0.1, 0.3])
    evals = []
    for label, acc in (("init", 0.0), ("grpo", 0.125)):
        path = tmp_path / f"{label}.json"
        path.write_text(
            json.dumps(
                {
                    "accuracy": acc,
                    "reward": acc,
                    "reward_fmt": 1.0,
                    "answered": 1.0,
                    "grounded": 0.5,
                    "fatal_rate": 0.0,
                    "turns_mean": 3.0,
                    "scored": 32,
                }
            )
        )
        evals.append((label, path))
    lines = summary_lines(sft_run, grpo_run, 1, evals, prior=prior)
    assert "accuracy 0.200; grpo is NOT above it (the prior is inside grpo's 95% interval)" in lines[4]
    prior.write_text(json.dumps({"accuracy": 0.1, "prompts": 4}))
    assert "grpo is above it (the prior is inside" in summary_lines(sft_run, grpo_run, 1, evals, prior=prior)[4]
    prior.write_text(json.dumps({"accuracy": 0.02, "prompts": 4}))  # below 4 of 32's interval [0.050, 0.281]
    assert "grpo is above it (the prior is outside" in summary_lines(sft_run, grpo_run, 1, evals, prior=prior)[4]


def test_the_demo_module_imports_light_for_the_tool_workers():
    """`python -m osvl.demo evaluate` spawns tool workers, and a spawned worker re-imports the parent's
    __main__: importing torch and the trainer there made every worker of each evaluation pay for them."""
    watched = ("torch", "torchtitan", "cv2", "osvl.config", "osvl.eval", "osvl.model", "osvl.trainer")
    assert fresh_imports("import osvl.demo", watched) == []


def test_seed_lines_pair_each_sft_seed_with_its_grpo_and_pool_them_over_anchors(tmp_path, capsys):
    prompts = [f"q{i}" for i in range(40)]
    anchors = {p: f"e{i // 4}" for i, p in enumerate(prompts)}  # 10 anchor entities of 4 questions each
    runs = []
    for seed, (known, gained) in enumerate(((10, 8), (9, 6), (10, 7))):  # each SFT seed, then its GRPO's gain
        sft = {p: float(i % 4 == 0 and i // 4 < known) for i, p in enumerate(prompts)}
        grpo = {p: float(sft[p] or (i % 4 == 1 and i // 4 < gained)) for i, p in enumerate(prompts)}
        paths = [
            _write_eval(tmp_path / f"{stage}{seed}.json", sum(accs.values()) / 40, per_prompt=accs, anchors=anchors)
            for stage, accs in (("sft", sft), ("grpo", grpo))
        ]
        runs.append((f"seed{seed}", *paths))
    lines = seed_lines(runs)
    assert lines[0] == "3 seeds of the whole recipe on 40 prompts (10 anchors):"
    assert lines[1].startswith("  seed0: sft 0.250  grpo 0.450  grpo - sft +0.200 [")
    assert lines[1].endswith("over anchors") and "over prompts, [" in lines[1]
    assert lines[4].startswith("  mean over seeds: +0.175 [") and "over seeds and anchors" in lines[4]
    assert "3 of 3 seeds gain >= +0.10 with an interval clear of zero" in lines[4]
    # without anchors the bootstrap is over prompts; a seed below the bar is counted out
    low = {p: float(i < 11) for i, p in enumerate(prompts)}
    base = {p: float(i < 10) for i, p in enumerate(prompts)}
    plain = [
        (
            name,
            _write_eval(tmp_path / f"p{name}b.json", 0.25, per_prompt=base),
            _write_eval(tmp_path / f"p{name}a.json", a, per_prompt=accs),
        )
        for name, a, accs in (("s0", 0.275, low), ("s1", 0.45, {p: float(i < 18) for i, p in enumerate(prompts)}))
    ]
    lines = seed_lines(plain)
    assert lines[0] == "2 seeds of the whole recipe on 40 prompts (40 prompts):" and "over anchors" not in lines[1]
    assert "1 of 2 seeds gain >= +0.10" in lines[3]
    other = _write_eval(tmp_path / "other.json", 0.1, per_prompt={"x": 1.0})
    with pytest.raises(ValueError, match="other prompts"):
        seed_lines([runs[0], ("bad", runs[1][1], other)])
    with pytest.raises(ValueError, match="cannot be paired"):
        seed_lines([("old", _write_eval(tmp_path / "old.json", 0.1), runs[0][2])])
    with pytest.raises(SystemExit):
        main(["seeds", "--run", f"seed0={runs[0][1]}"])  # one evaluation, not two
    assert main(["seeds", "--run", *(f"{n}={b},{a}" for n, b, a in runs)]) == 0
    assert "mean over seeds: +0.175" in capsys.readouterr().out


def test_summary_pairs_over_anchors_and_counts_right_answers_by_hops(tmp_path):
    sft = fake_run(tmp_path / "sft", "fatal_clamp", [0.0, 0.0])
    grpo = fake_run(tmp_path / "grpo", "fatal_clamp", [0.1, 0.3])
    prompts = [f"q{i}" for i in range(40)]
    anchors = {p: f"e{i // 8}" for i, p in enumerate(prompts)}  # 5 entities of 8 questions
    hops = {p: 1 + (i % 2) for i, p in enumerate(prompts)}
    before = {p: 0.0 for p in prompts}
    after = {p: float(i < 16) for i, p in enumerate(prompts)}  # the gain is two whole entities'
    evals = [
        (label, _write_eval(tmp_path / f"{label}.json", sum(a.values()) / 40, per_prompt=a, anchors=anchors, hops=hops))
        for label, a in (("sft", before), ("grpo", after))
    ]
    lines = summary_lines(sft, grpo, 1, evals)
    assert "  sft   right by hops: 1 hop 0/20, 2 hops 0/20" in lines
    assert "  grpo  right by hops: 1 hop 8/20, 2 hops 8/20" in lines
    row = next(line for line in lines if line.startswith("  grpo - sft:"))
    # over prompts 16 of 40 turned right and none wrong: clear of zero; over 5 entities, 2 of which gained, it is not
    assert "(95% paired bootstrap over 40 prompts), [+0.000," in row and "over 5 anchors" in row
    assert row.endswith("grpo is not distinguishable from sft")
    assert float(row.split("[")[1].split(",")[0]) > 0  # the prompt interval alone would have said higher
    # evaluations without anchors or hops: the prompt interval decides, no hops row
    plain = [
        (label, _write_eval(tmp_path / f"p{label}.json", 0.2, per_prompt=a))
        for label, a in (("sft", before), ("grpo", after))
    ]
    lines = summary_lines(sft, grpo, 1, plain)
    assert not any("right by hops" in line for line in lines)
    assert next(line for line in lines if line.startswith("  grpo - sft:")).endswith("grpo is higher than sft")


def test_timed_phases_log_each_commands_seconds_and_status_and_the_summary_ends_with_them(tmp_path, monkeypatch):
    log = tmp_path / "phases.jsonl"
    assert (
        main(["timed", "--log", str(log), "--phase", "sft", "--", sys.executable, "-c", "import time; time.sleep(0.3)"])
        == 0
    )
    assert main(["timed", "--log", str(log), "--phase", "eval", "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert main(["timed", "--log", str(log), "--phase", "sft", "--", sys.executable, "-c", "pass"]) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["phase"], r["returncode"]) for r in records] == [("sft", 0), ("eval", 3), ("sft", 0)]
    assert records[0]["seconds"] >= 0.3
    started = tmp_path / "started"
    started.write_text("1000\n")
    monkeypatch.setattr(time, "time", lambda: 1100.0)
    lines = phase_lines(log, started)
    total = sum(r["seconds"] for r in records)
    assert lines[0].startswith("seconds by phase: sft ") and "  eval " in lines[0]  # first-run order, sft summed
    assert lines[1] == f"since the job started: 100 s ({100 - total:.0f} s outside the phases)"
    with pytest.raises(SystemExit):
        main(["timed", "--log", str(log), "--phase", "x", "--"])  # no command
