"""A policy that samples reserved vision tokens: engines never emit them, the agent loop ends such a
trajectory typed, the rest of the batch completes and the trainer can still render and pack it."""

import asyncio
import dataclasses

import pytest
import torch

import osvl.rollout.local_engine as local_engine_module
from osvl.data.packing import pack_microbatch, train_sequence
from osvl.model import build_model
from osvl.rl.trajectory import FinishReason, ToolStatus
from osvl.rollout.agent import AgentConfig, malformed_step
from osvl.rollout.engine import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StopKind,
    derive_seed,
)
from osvl.rollout.local_engine import LocalEngine, ReplayEngine
from osvl.rollout.reserved import find_unusable, reserved_vision_ids
from osvl.rollout.sampling import make_generator, sample_next
from osvl.rollout.workers import RolloutMetrics, RolloutWorkerConfig, stream_groups
from tests.rollout.helpers import IMAGE_CONFIG, model_config, prompts, tokenizer
from tests.rollout.scripts import call, respond, scripted


def test_reserved_vision_ids_and_find_unusable():
    tok = tokenizer()
    s = tok.special
    reserved = reserved_vision_ids(tok)
    assert reserved == tuple(
        sorted({s.vision_start, s.vision_end, s.image_pad, s.video_pad, tok.backend.token_to_id("<|vision_pad|>")})
    )
    assert s.im_end not in reserved and s.tool_call_end not in reserved
    ids = [5, s.image_pad, 6, tok.vocab_size, -1, s.vision_end]
    assert [(u.position, u.token_id) for u in find_unusable(ids, reserved, tok.vocab_size)] == [
        (1, s.image_pad),
        (3, tok.vocab_size),
        (4, -1),
        (5, s.vision_end),
    ]
    assert find_unusable([5, 6, s.im_end], reserved, tok.vocab_size) == []


def test_sample_next_never_picks_banned_ids_and_reports_the_unbanned_logprob():
    logits = torch.tensor([0.0, 1.0, 0.5, 9.0, 8.0])  # ids 3 and 4 dominate
    banned = torch.tensor([3, 4])
    assert sample_next(logits, 0.0, 1.0, None)[0] == 3  # control: without the ban the argmax wins
    token, logprob = sample_next(logits, 0.0, 1.0, None, banned)
    assert token == 1 and logprob == pytest.approx(float(torch.log_softmax(logits.double(), 0)[1]), abs=1e-6)
    unbanned = {sample_next(logits, 1.0, 1.0, make_generator(s))[0] for s in range(30)}
    assert unbanned & {3, 4}  # control: the draw would pick them
    for seed in range(30):
        for temperature, top_p in ((1.0, 1.0), (2.0, 0.9), (0.5, 0.5)):
            token, logprob = sample_next(logits, temperature, top_p, make_generator(seed), banned)
            assert token in (0, 1, 2)
            expected = torch.log_softmax(logits.double() / temperature, 0)[token]
            assert logprob == pytest.approx(float(expected), abs=1e-6)


def test_local_engine_never_samples_reserved_or_padded_ids_even_as_argmax(monkeypatch, renderer):
    tok = tokenizer()
    config = model_config()
    config = dataclasses.replace(config, text=dataclasses.replace(config.text, vocab_size=tok.vocab_size + 6))
    torch.manual_seed(0)
    engine = LocalEngine(build_model(config), tok, IMAGE_CONFIG)
    banned = [*reserved_vision_ids(tok), *range(tok.vocab_size, tok.vocab_size + 6)]
    segment = renderer.render_prompt(prompts(1)[0])  # with an image
    requests = [
        GenerationRequest(
            segment.ids, segment.images, SamplingParams(temperature=t, top_p=p, max_new_tokens=6, stop=(), seed=seed)
        )
        for t, p, seed in ((0.0, 1.0, None), (1.0, 1.0, 1), (1.0, 0.8, 2), (0.7, 1.0, 3))
    ]
    plain = engine.generate_batch(requests)

    real_extend = local_engine_module.extend

    def rigged_extend(*args, **kwargs):  # every banned id becomes the argmax by a wide margin
        logits = real_extend(*args, **kwargs).clone()
        logits[..., banned] += 30.0
        return logits

    monkeypatch.setattr(local_engine_module, "extend", rigged_extend)
    rigged = engine.generate_batch(requests)
    for result in rigged:
        assert len(result.token_ids) == 6 and not set(result.token_ids) & set(banned)
    greedy, rigged_greedy = plain[0], rigged[0]
    assert rigged_greedy.token_ids == greedy.token_ids  # the ban leaves the order of allowed ids alone
    # the logprob is of the full distribution, where the banned ids now hold almost all the mass
    assert all(r < p - 15 for r, p in zip(rigged_greedy.logprobs, greedy.logprobs))


class InjectOnSeeds:
    """Forwards to ``inner`` but answers requests with one of ``seeds`` with fixed ``token_ids``, as a
    server that does not mask reserved ids would; records every request it sees."""

    def __init__(self, inner, seeds, token_ids) -> None:
        self.inner, self.seeds, self.token_ids = inner, set(seeds), list(token_ids)
        self.requests: list[GenerationRequest] = []

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    async def generate(self, request):
        self.requests.append(request)
        if request.sampling.seed in self.seeds:
            return GenerationResult(
                self.token_ids,
                [-0.25] * len(self.token_ids),
                StopKind.STOP,
                self.inner.policy_version,
                len(request.input_ids),
            )
        return await self.inner.generate(request)


def test_image_pad_mid_batch_ends_one_trajectory_typed_and_the_trainer_can_pack_it(local_engine, env, renderer):
    tok = tokenizer()
    pad = tok.special.image_pad
    prefix = tok.encode("<think>look again</think>\n")
    engine_ids = prefix + [pad, pad] + tok.encode(call("echo", tag="z"))
    turns = [call("echo_image", image=0, tag="x"), respond()]
    second_turn_of_p1_1 = derive_seed(0, "p1", 1) + 1
    engine = InjectOnSeeds(ReplayEngine(local_engine, scripted(turns)), {second_turn_of_p1_1}, engine_ids)
    agent = AgentConfig(max_turns=3, sampling=SamplingParams(temperature=1.0, max_new_tokens=64))
    metrics = RolloutMetrics()

    async def collect():
        return [
            g
            async for g in stream_groups(
                prompts(3),
                engine,
                env,
                renderer,
                agent,
                RolloutWorkerConfig(group_size=2, max_in_flight=6),
                metrics=metrics,
            )
        ]

    groups = asyncio.run(collect())
    assert sorted(g.group_id for g in groups) == [0, 1, 2] and all(len(g.trajectories) == 2 for g in groups)
    by_key = {(g.prompt.id, t.sample_index): t for g in groups for t in g.trajectories}
    bad = by_key.pop(("p1", 1))
    assert all(t.finish_reason is FinishReason.RESPONSE for t in by_key.values())
    assert bad.finish_reason is FinishReason.MALFORMED and bad.fatal_step == 2  # no response: fatal at its end
    assert bad.statuses == [ToolStatus.OK, ToolStatus.PARSE_ERROR]
    step = bad.steps[1]
    assert step.token_ids == prefix and step.logprobs == [-0.25] * len(prefix) and step.response is None
    assert f"<|image_pad|> (id {pad}) at {len(prefix)}" in step.tool_result.error
    assert str(engine_ids) in step.tool_result.error  # the exact engine output is kept
    assert metrics.statuses["parse_error"] == 1
    reserved = set(reserved_vision_ids(tok))
    assert all(reserved <= set(r.sampling.stop_token_ids) for r in engine.requests)  # a server stops at them

    rendered = renderer.render_trajectory(bad)  # prompt image + the tool's image, no stray pad
    assert len(rendered.images) == 2
    batch = pack_microbatch([train_sequence(bad, renderer, reward=0.0)], renderer.image_config, tok.special)
    assert batch.num_seqs == 1 and batch.num_tokens == len(rendered.input_ids)
    raw = dataclasses.replace(
        bad, steps=[bad.steps[0], dataclasses.replace(step, token_ids=engine_ids, logprobs=[-0.25] * len(engine_ids))]
    )
    with pytest.raises(ValueError, match="image tokens"):  # what the trainer would have hit
        renderer.render_trajectory(raw)


@pytest.mark.parametrize("bad", ["vision_start", "video_pad", "out_of_vocabulary"])
def test_malformed_step_keeps_the_prefix_and_names_every_bad_id(renderer, bad):
    tok = tokenizer()
    bad_id = tok.vocab_size + 2 if bad == "out_of_vocabulary" else getattr(tok.special, bad)
    prefix = tok.encode("<think>x</think>")
    ids = prefix + [bad_id] + tok.encode("y") + [tok.special.image_pad]
    result = GenerationResult(ids, [-float(i) for i in range(len(ids))], StopKind.LENGTH, policy_version=4)
    step = malformed_step(result, renderer, reserved_vision_ids(tok))
    assert step.token_ids == prefix and step.logprobs == [-float(i) for i in range(len(prefix))]
    assert step.status is ToolStatus.PARSE_ERROR and step.policy_version == 4 and step.text == "<think>x</think>"
    name = "out-of-vocabulary" if bad == "out_of_vocabulary" else tok.special.token(bad)
    assert f"{name} (id {bad_id}) at {len(prefix)}" in step.tool_result.error
    assert f"<|image_pad|> (id {tok.special.image_pad}) at {len(ids) - 1}" in step.tool_result.error
    clean = GenerationResult(prefix, [0.0] * len(prefix), StopKind.STOP)
    assert malformed_step(clean, renderer, reserved_vision_ids(tok)) is None
