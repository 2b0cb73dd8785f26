"""Lookup drills (short search chains over the world graph) and name drills, for a policy that
starts from random weights.

The paper's SFT starts from a pretrained Qwen3-VL, which can already copy a name it has just
read into its next query. A tiny policy trained from scratch on a few hundred expert chains
memorizes frequent names instead ("Mask of Mask of ..."). Drills supply that skill with many
cheap, diverse examples of the same moves the expert makes: a named entity, ``text_search`` for
one relation at a time, copy the entity the passage states, read the asked attribute, answer.

Every observation comes from the same exact tool stand-ins as the scripted expert, the question
uses the canonical wording of curated items, and no entity on the path of any RL item appears in
a drill, so the RL prompts stay unseen by SFT.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections import Counter
from collections.abc import Iterable, Sequence

from osvl.rl.trajectory import FinishReason, Prompt, ToolCall, ToolResult, ToolStatus, Trajectory
from osvl.synth.expert import WorldTools, answer_step, expert_step, read_passages, top_match_page
from osvl.tools.faults import INJECTED
from osvl.world.build import World
from osvl.world.generate import CAPTION_RELATIONS, image_caption
from osvl.world.graph import Page

_TOP_CAPTION = re.compile(r"^Caption: .*$", re.MULTILINE)
RETRY_THINK = "The call failed; make it again."


def _stated(observation: str, pattern: re.Pattern[str]) -> list[str]:
    return list(dict.fromkeys(m for _, _, summary in read_passages(observation) for m in pattern.findall(summary)))


def with_caption_link(result: ToolResult, page: Page, world: World, rng: random.Random) -> ToolResult:
    """The image_search ``result`` with its top caption stating one true, randomly drawn link of ``page``
    (as a quarter of the world's captions do), or unchanged when the page has no such link.

    A world gives only some entities such a caption, so a policy sees the same few linked names after
    the same few images and learns per entity which name to search; drawn per drill, the linked name
    varies and only the match's own title stays the one to search."""
    links = [link for link in page.links if link.relation in CAPTION_RELATIONS and world.graph.resolve(link.target)]
    if not links:
        return result
    link = rng.choice(links)
    named = link.anchor or world.graph[world.graph.resolve(link.target)].title
    caption = f"Caption: {image_caption(page, link.relation, named)}"
    return dataclasses.replace(result, text=_TOP_CAPTION.sub(lambda _: caption, result.text, count=1))


def with_tool_faults(drill: Trajectory, rate: float, rng: random.Random, max_consecutive: int = 2) -> Trajectory:
    """The ``drill`` with each tool call failing first with probability ``rate`` (again after a failed
    retry, at most ``max_consecutive`` times in a row), as the GRPO stage's injected faults fail it
    (``tool_error``, "injected fault"); the expert then makes the same call again.

    Without such steps SFT never shows an error observation, and the policy answers one by moving on
    as if the call had worked (it named a next entity it never read in 0 of 42 faults retried)."""
    if not 0.0 <= rate <= 1.0 or max_consecutive < 0:
        raise ValueError(
            f"with_tool_faults needs rate in [0, 1] and max_consecutive >= 0, got {rate}, {max_consecutive}"
        )
    steps = []
    for step in drill.steps:
        failures = 0
        while step.tool_call is not None and failures < max_consecutive and rng.random() < rate:
            failed = ToolResult(status=ToolStatus.TOOL_ERROR, tool=step.tool_call.name, error=INJECTED)
            steps.append(expert_step(step.think if not failures else RETRY_THINK, step.tool_call, failed))
            failures += 1
        steps.append(expert_step(RETRY_THINK, step.tool_call, step.tool_result) if failures else step)
    return dataclasses.replace(drill, steps=steps)


def with_recalled_answer(drill: Trajectory) -> Trajectory:
    """The ``drill`` answered from the expert's own knowledge: the attribute lookup dropped, the same
    answer step (it restates the fact, now read nowhere) right after the last relation hop.

    A teacher that knows the world answers some questions without the last lookup; a policy cloned from
    it learns to state a value it has not read, which is a guess on an entity SFT never showed it. The
    outcome reward is what can teach the policy to look the value up instead."""
    lookup, answer = drill.steps[-2:]
    if lookup.tool_call is None or lookup.tool_call.name != "text_search" or answer.response is None:
        raise ValueError(f"with_recalled_answer needs a drill ending in a lookup and its answer: {drill.prompt.id}")
    return dataclasses.replace(drill, steps=[*drill.steps[:-2], answer])


def guess_rates(world: World) -> dict[tuple[str, str], float]:
    """For each (entity kind, attribute): the share of that kind's entities that hold its most
    common value, i.e. how often answering that value blindly would be right."""
    values: dict[tuple[str, str], Counter[str]] = {}
    for page in world.graph.entities():
        for attribute, value in page.infobox.items():
            values.setdefault((page.kind or "", attribute), Counter())[value] += 1
    return {key: counts.most_common(1)[0][1] / counts.total() for key, counts in values.items()}


def _drill(
    world: World,
    tools: WorldTools,
    anchor: str,
    hops: int,
    rng: random.Random,
    excluded: set[str],
    search_top_k: int,
    group_id: int,
    visual: bool,
    guessable: set[tuple[str, str]],
    caption_link_fraction: float = 0.0,
) -> Trajectory | None:
    """One chain from ``anchor`` (named, or ``visual``: its image, identified by image_search), or
    None when the tools would not make it unambiguous or its answer is ``guessable``; a
    ``caption_link_fraction`` of visual chains see a caption that states a drawn link (``with_caption_link``)."""
    graph = world.graph
    if visual and not graph[anchor].images:
        return None
    path, relations = [anchor], []
    for _ in range(hops):
        links = [(link.relation, graph.resolve(link.target)) for link in graph[path[-1]].links]
        links = [
            (r, t)
            for r, t in links
            if t is not None
            and t not in excluded
            and t not in path
            and graph[t].domain is not None
            and len(graph.edges(path[-1], r)) == 1
        ]
        if not links:
            return None
        relation, target = rng.choice(links)
        path.append(target)
        relations.append(relation)
    kind = graph[path[-1]].kind or ""
    attributes = sorted((a, v) for a, v in graph[path[-1]].infobox.items() if (kind, a) not in guessable)
    if not attributes:
        return None
    attribute, answer = rng.choice(attributes)
    question = f"What is the {attribute}"
    for relation in reversed(relations):
        question += f" of the {relation}"
    question += (
        f" of the {graph[anchor].kind or 'entity'} shown in the image?" if visual else f" of {graph[anchor].title}?"
    )
    images = [world.load_image(anchor)] if visual else []

    steps = []

    def search(think: str, query: str):
        call = ToolCall("text_search", {"query": query, **({"top_k": search_top_k} if search_top_k else {})})
        result = tools(call, [])
        steps.append(expert_step(think, call, result))
        return result.text

    if visual:
        call = ToolCall("image_search", {"image": 0, "top_k": 1})
        result = tools(call, images)
        if caption_link_fraction and rng.random() < caption_link_fraction:
            result = with_caption_link(result, graph[anchor], world, rng)
        steps.append(expert_step("Identify what the image shows with a reverse image search.", call, result))
        if top_match_page(result.text) != anchor:
            return None
    for node, relation, target in zip(path[:-1], relations, path[1:], strict=True):
        title = graph[node].title
        observation = search(f"Find the {relation} of {title}.", f"{title} {relation}")
        stated = _stated(observation, re.compile(rf"The {re.escape(relation)} of {re.escape(title)} is ([^.]+)\."))
        if stated != [graph[target].title]:
            return None  # the passage names no single next entity: not a clean drill
    title = graph[path[-1]].title
    observation = search(f"Look up the {attribute} of {title}.", f"{title} {attribute}")
    if _stated(observation, re.compile(rf"Its {re.escape(attribute)} is ([^.]+)\.")) != [answer]:
        return None
    steps.append(answer_step(attribute, title, answer, answer))
    kind = "image" if visual else "named"
    prompt = Prompt(
        id=f"drill-{kind}-{anchor}-{'-'.join(relations)}-{attribute}",
        question=question,
        images=images,
        answer=answer,
        anchor=anchor,
        hops=len(relations),
    )
    return Trajectory(
        prompt=prompt, steps=steps, finish_reason=FinishReason.RESPONSE, group_id=group_id, sample_index=0
    )


def lookup_drills(
    world: World,
    count: int,
    seed: int = 0,
    excluded: Iterable[str] = (),
    search_top_k: int = 1,
    max_hops: int = 2,
    visual_fraction: float = 0.5,
    anchors: Iterable[str] | None = None,
    max_guess_rate: float = 1.0,
    caption_link_fraction: float = 0.0,
    hop_shares: Sequence[float] | None = None,
    tool_fault_rate: float = 0.0,
    recall_fraction: float = 0.0,
) -> list[Trajectory]:
    """``count`` distinct drills of 1..``max_hops`` relation hops plus one attribute lookup; a
    ``visual_fraction`` of them start from the anchor's image, as curated questions do. Chains
    start from ``anchors`` (default: every entity) and never touch an ``excluded`` one. An answer
    that a blind guess would get right more often than ``max_guess_rate`` (``guess_rates``: a
    country's area when the world has three countries) is never asked. A ``caption_link_fraction`` of
    the visual drills see their image's caption state a drawn true link (``with_caption_link``).
    ``hop_shares`` (one share per hop count, 1..``max_hops``): exactly that share of the drills has that
    many hops (largest remainders), where otherwise each attempt draws its hop count uniformly and the
    longer chains, rejected more often, end up fewer. A ``tool_fault_rate`` fails that share of the tool
    calls once first, and the expert retries (``with_tool_faults``; drawn apart from the drills, which stay
    the same). A ``recall_fraction`` of the ``max_hops`` drills answer without the attribute lookup
    (``with_recalled_answer``; drawn apart too)."""
    if (
        count < 0
        or max_hops < 1
        or search_top_k < 0
        or not 0.0 <= visual_fraction <= 1.0
        or not 0.0 < max_guess_rate <= 1.0
        or not 0.0 <= caption_link_fraction <= 1.0
        or not 0.0 <= tool_fault_rate <= 1.0
        or not 0.0 <= recall_fraction <= 1.0
    ):
        raise ValueError(
            f"lookup_drills needs count >= 0, max_hops >= 1, search_top_k >= 0; got "
            f"{count}, {max_hops}, {search_top_k} (and visual_fraction in [0, 1], got {visual_fraction}; "
            f"max_guess_rate in (0, 1], got {max_guess_rate}; caption_link_fraction in [0, 1], got "
            f"{caption_link_fraction}; tool_fault_rate in [0, 1], got {tool_fault_rate}; recall_fraction in "
            f"[0, 1], got {recall_fraction})"
        )
    quota = hop_quota(count, max_hops, hop_shares)
    excluded = set(excluded)
    pool = {p.id for p in world.graph.entities()} if anchors is None else set(anchors)
    unknown = sorted(a for a in pool if a not in world.graph)
    if unknown:
        raise ValueError(f"lookup_drills: anchors not in the world: {unknown[:3]}")
    anchors = sorted(pool - excluded)
    if count and not anchors:
        raise ValueError("lookup_drills: every entity is excluded")
    guessable = {key for key, rate in guess_rates(world).items() if rate > max_guess_rate}
    rng, tools = random.Random(seed), WorldTools(world)
    drills: dict[str, Trajectory] = {}
    hops_of: dict[str, int] = {}
    attempts = 0
    while len(drills) < count:
        attempts += 1
        if attempts > 50 * count + 100:
            raise ValueError(
                f"lookup_drills: only {len(drills)} distinct drills of {count} after {attempts - 1} "
                "attempts; the world is too small or too excluded"
            )
        hops = rng.randint(1, max_hops) if quota is None else rng.choice([h for h, n in quota.items() if n])
        drill = _drill(
            world,
            tools,
            rng.choice(anchors),
            hops,
            rng,
            excluded,
            search_top_k,
            group_id=len(drills),
            visual=rng.random() < visual_fraction,
            guessable=guessable,
            caption_link_fraction=caption_link_fraction,
        )
        if drill is not None and drill.prompt.id not in drills:
            drills[drill.prompt.id] = drill
            hops_of[drill.prompt.id] = hops
            if quota is not None:
                quota[hops] -= 1
    recall_rng = random.Random(f"recall/{seed}")
    shaped = [
        with_recalled_answer(d) if hops_of[i] == max_hops and recall_rng.random() < recall_fraction else d
        for i, d in drills.items()
    ]
    if not tool_fault_rate:
        return shaped
    fault_rng = random.Random(f"tool-faults/{seed}")
    return [with_tool_faults(drill, tool_fault_rate, fault_rng) for drill in shaped]


def hop_quota(count: int, max_hops: int, hop_shares: Sequence[float] | None) -> dict[int, int] | None:
    """How many of ``count`` drills get 1..``max_hops`` hops under ``hop_shares`` (largest remainders, so
    the counts add up to ``count``); None without shares."""
    if hop_shares is None:
        return None
    shares = [float(x) for x in hop_shares]
    if len(shares) != max_hops or any(not 0.0 <= x <= 1.0 for x in shares) or abs(sum(shares) - 1.0) > 1e-6:
        raise ValueError(
            f"hop_shares needs one share in [0, 1] per hop count 1..{max_hops}, summing to 1; got {shares}"
        )
    exact = [count * x for x in shares]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(max_hops), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: count - sum(counts)]:
        counts[i] += 1
    return {hops: n for hops, n in enumerate(counts, start=1)}


def name_drills(world: World, count: int, seed: int = 0, names: tuple[int, int] = (3, 6)) -> list[Trajectory]:
    """``count`` drills that each list a few of the world's entity names and ask for them back.

    With one id per entity name (``osvl.demo tokenizer --entity-world``), the names of held-out
    entities would appear in no training text; Adam then moves their tied embeddings only through the
    softmax's push-down of every wrong id, which drives them all towards one direction (mean pairwise
    cosine 0.61 against 0.26 for names seen in training, measured on the demo's SFT policy), and a
    policy cannot copy a name it cannot tell apart from the others. Here every name, held-out ones
    included, is a target now and then (the names cycle through seeded shuffles), and no drill states a
    fact about any entity: the questions stay unseen."""
    if count < 0 or not 1 <= names[0] <= names[1]:
        raise ValueError(f"name_drills needs count >= 0 and 1 <= names[0] <= names[1], got {count}, {names}")
    titles = sorted(page.title for page in world.graph.entities())
    if count and not titles:
        raise ValueError("name_drills: the world has no entities")
    rng, queue, drills = random.Random(seed), [], []
    for index in range(count):
        size = rng.randint(*names)
        while len(queue) < size:
            queue += rng.sample(titles, len(titles))
        chosen, queue = queue[:size], queue[size:]
        listed = "; ".join(chosen)
        prompt = Prompt(id=f"names-{seed}-{index}", question=f"Repeat these names: {listed}.", answer=listed)
        step = expert_step("Repeat the names in order.", None, None, response=listed)
        drills.append(Trajectory(prompt, [step], FinishReason.RESPONSE, group_id=index, sample_index=0))
    return drills


def split_anchors(anchors: Iterable[str], eval_fraction: float, seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, eval): a seeded shuffle of the sorted ``anchors`` cut at ``eval_fraction``, so held-out
    questions can start at entities that no training question starts at (the split is fixed by the
    seed and the anchor set alone, before any result is seen)."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must lie in (0, 1), got {eval_fraction}")
    ordered = sorted(set(anchors))
    random.Random(seed).shuffle(ordered)
    cut = round(eval_fraction * len(ordered))
    if not 0 < cut < len(ordered):
        raise ValueError(f"cannot split {len(ordered)} anchors at {eval_fraction}: one side would be empty")
    return sorted(ordered[cut:]), sorted(ordered[:cut])


def held_out_prompts(
    world: World,
    anchors: Iterable[str],
    count: int,
    seed: int = 0,
    search_top_k: int = 1,
    max_hops: int = 2,
    max_guess_rate: float = 1.0,
    hop_shares: Sequence[float] | None = None,
) -> list[Prompt]:
    """Short visual questions (1..``max_hops`` hops) about entities SFT drills leave out: RL
    prompts a policy trained from scratch can already answer sometimes, so GRPO gets a signal
    that the curated 3-5 hop items do not give it. Each is checked the way a drill is.
    ``hop_shares`` as for :func:`lookup_drills` (e.g. ``(0, 0, 1)``: 3-hop questions only, a probe of a
    chain longer than the training's)."""
    drills = lookup_drills(
        world,
        count,
        seed,
        search_top_k=search_top_k,
        max_hops=max_hops,
        visual_fraction=1.0,
        anchors=anchors,
        max_guess_rate=max_guess_rate,
        hop_shares=hop_shares,
    )
    return [drill.prompt for drill in drills]
