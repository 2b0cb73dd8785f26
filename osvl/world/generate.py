"""Procedural generation of the mini-world graph: entities, typed relations, infoboxes, and the
pages that exercise the sampling rules (hubs, disambiguation, list, category pages, redirects).

Everything is drawn from one ``random.Random(seed)`` in a fixed order, so a seed fixes the world.
An edge ``A --relation--> B`` reads "B is the <relation> of A" ("the architect of Varnel Tower").
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from osvl.world.graph import ImageRef, Link, Page, compute_in_degrees, page_id

SYLLABLES = (
    "ar",
    "bel",
    "cor",
    "dan",
    "el",
    "fen",
    "gar",
    "hal",
    "is",
    "jor",
    "kel",
    "lun",
    "mar",
    "nor",
    "os",
    "pel",
    "quen",
    "ros",
    "sal",
    "tor",
    "ul",
    "vor",
    "wen",
    "yar",
    "zel",
    "bri",
    "dra",
    "mi",
    "tal",
    "sen",
    "ka",
    "lo",
)
_BUILDING_KINDS = ("tower", "lighthouse", "zoo", "museum", "bridge", "theatre", "library")
_ORGANISM_KINDS = ("heron", "frog", "beetle", "orchid", "lizard", "moth")
_ARTIFACT_KINDS = ("vase", "helmet", "sword", "tapestry", "clock", "mask")
_OCCUPATIONS = (
    "painter",
    "architect",
    "naturalist",
    "engineer",
    "sculptor",
    "botanist",
    "mayor",
    "zookeeper",
    "clockmaker",
    "historian",
)
_STYLES = ("gothic", "baroque", "brutalist", "art deco", "neoclassical", "modernist")
_STATUSES = ("least concern", "near threatened", "vulnerable", "endangered")
_MATERIALS = ("bronze", "silver", "oak", "porcelain", "iron", "silk", "jade")
_NICK_ADJ = ("Silent", "Copper", "Northern", "Lantern", "Iron", "Wandering", "Golden", "Red")
_NICK_NOUN = ("Keeper", "Hunter", "Builder", "Scholar", "Admiral", "Weaver", "Painter", "Warden")
_MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)
VISUAL_DOMAINS = ("Person", "Building/Place", "Location", "Organism", "Artifact")


_SCALED = ("cities", "persons", "buildings", "organisms", "artifacts")


@dataclass(frozen=True)
class WorldConfig:
    """Sizes and knobs of a generated world; the defaults give a few hundred entities."""

    seed: int = 0
    countries: int = 3  # every located entity links its country: these become the hubs
    cities: int = 24
    persons: int = 96
    buildings: int = 48
    organisms: int = 36
    artifacts: int = 36
    shared_names: int = 3  # person pairs sharing a name -> "(disambiguation)" pages
    nickname_fraction: float = 0.3  # persons with a nickname redirect
    redirect_link_fraction: float = 0.5  # links to a nicknamed person that go through the redirect
    image_size: int = 512
    small_image_fraction: float = 0.15  # images below the 512x512 seed rule
    small_image_size: int = 384
    leaky_caption_fraction: float = 0.25  # captions that state one relation (one-hop leakage)

    def scaled(self, factor: int) -> WorldConfig:
        """The same world recipe with ``factor`` times the cities, persons, buildings, organisms and
        artifacts (the country hubs stay few, so they stay hubs)."""
        if factor < 1:
            raise ValueError(f"world scale must be >= 1, got {factor}")
        return dataclasses.replace(self, **{name: getattr(self, name) * factor for name in _SCALED})

    def __post_init__(self) -> None:
        for name in ("countries", "cities", "persons", "buildings", "organisms", "artifacts"):
            if getattr(self, name) < 2:
                raise ValueError(f"WorldConfig.{name} must be >= 2, got {getattr(self, name)}")
        if self.shared_names * 2 > self.persons:
            raise ValueError("WorldConfig.shared_names needs two persons per shared name")
        for name in ("nickname_fraction", "redirect_link_fraction", "small_image_fraction", "leaky_caption_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"WorldConfig.{name} must lie in [0, 1], got {getattr(self, name)}")
        if self.image_size < 64 or self.small_image_size < 64:
            raise ValueError("WorldConfig image sizes must be >= 64 pixels")


def _date(rng: random.Random, lo: int, hi: int) -> str:
    return f"{rng.randrange(1, 29)} {rng.choice(_MONTHS)} {rng.randrange(lo, hi)}"


class _Names:
    """Unique pronounceable names; a used name is never handed out twice."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, set()

    def word(self, syllables: tuple[int, int] = (2, 3)) -> str:
        while True:
            word = "".join(self.rng.choice(SYLLABLES) for _ in range(self.rng.randint(*syllables)))
            if word not in self.used:
                self.used.add(word)
                return word.capitalize()


def generate_pages(config: WorldConfig) -> list[Page]:
    """All pages of the world in a stable order, in-degrees filled in."""
    rng = random.Random(config.seed)
    names = _Names(rng)
    pages: dict[str, Page] = {}

    def add(page: Page) -> Page:
        if page.id in pages:
            raise AssertionError(f"generator produced duplicate page id {page.id}")
        pages[page.id] = page
        return page

    def entity(title: str, domain: str, kind: str, infobox: dict[str, str]) -> Page:
        return add(Page(id=page_id(title), title=title, domain=domain, kind=kind, infobox=infobox))

    countries = [
        entity(
            names.word((2, 2)) + "land",
            "Location",
            "country",
            {"population": str(rng.randrange(2, 90) * 1_000_000), "area in km2": str(rng.randrange(20, 900) * 1000)},
        )
        for _ in range(config.countries)
    ]
    cities = [
        entity(
            names.word(),
            "Location",
            "city",
            {
                "population": str(rng.randrange(5, 900) * 1000),
                "founded": str(rng.randrange(900, 1900)),
                "elevation in metres": str(rng.randrange(2, 1800)),
            },
        )
        for _ in range(config.cities)
    ]
    persons = []
    for _index in range(config.persons):
        first, last = names.word((1, 2)), names.word((2, 3))
        persons.append(
            entity(
                f"{first} {last}",
                "Person",
                "person",
                {
                    "occupation": rng.choice(_OCCUPATIONS),
                    "birth date": _date(rng, 1850, 1990),
                    "height in cm": str(rng.randrange(150, 200)),
                    "citizenship date": _date(rng, 1900, 2020),
                },
            )
        )
    buildings = []
    for _ in range(config.buildings):
        kind = rng.choice(_BUILDING_KINDS)
        buildings.append(
            entity(
                f"{names.word()} {kind.capitalize()}",
                "Building/Place",
                kind,
                {
                    "opened": _date(rng, 1700, 2015),
                    "height in metres": str(rng.randrange(8, 300)),
                    "style": rng.choice(_STYLES),
                },
            )
        )
    organisms = []
    for _ in range(config.organisms):
        kind = rng.choice(_ORGANISM_KINDS)
        organisms.append(
            entity(
                f"{names.word()} {kind}",
                "Organism",
                kind,
                {
                    "conservation status": rng.choice(_STATUSES),
                    "length in cm": str(rng.randrange(1, 120)),
                    "year described": str(rng.randrange(1750, 2010)),
                },
            )
        )
    artifacts = []
    for _ in range(config.artifacts):
        kind = rng.choice(_ARTIFACT_KINDS)
        artifacts.append(
            entity(
                f"{kind.capitalize()} of {names.word()}",
                "Artifact",
                kind,
                {
                    "material": rng.choice(_MATERIALS),
                    "year made": str(rng.randrange(300, 1950)),
                    "weight in kg": str(rng.randrange(1, 400)),
                },
            )
        )

    def link(source: Page, target: Page, relation: str) -> None:
        source.links.append(Link(target=target.id, relation=relation, anchor=target.title))

    for city in cities:
        link(city, rng.choice(countries), "country")
        link(city, rng.choice(persons), "mayor")
    for person in persons:
        link(person, rng.choice(cities), "birthplace")
        link(person, rng.choice(countries), "citizenship")
    unmarried = persons[:]
    rng.shuffle(unmarried)
    for a, b in zip(unmarried[0::2][: len(unmarried) // 3], unmarried[1::2][: len(unmarried) // 3]):
        link(a, b, "spouse")
        link(b, a, "spouse")
    for child in persons:
        if rng.random() < 0.5:
            for parent in rng.sample([p for p in persons if p is not child], rng.randint(1, 2)):
                link(parent, child, "child")
                link(child, parent, "parent")
    for building in buildings:
        city = rng.choice(cities)
        link(building, city, "location")
        link(building, rng.choice(countries), "country")
        link(building, rng.choice(persons), "architect")
        link(building, rng.choice(persons), "director")
        for founder in rng.sample(persons, rng.randint(1, 2)):
            link(building, founder, "founder")
        link(city, building, "landmark")

    def both(source: Page, target: Page, relation: str, inverse: str) -> None:
        link(source, target, relation)
        link(target, source, inverse)

    for organism in organisms:
        both(organism, rng.choice(cities), "native region", "native species")
        link(organism, rng.choice(countries), "country")
        both(organism, rng.choice(persons), "describer", "described species")
        both(organism, rng.choice(buildings), "keeper", "resident species")
    for artifact in artifacts:
        both(artifact, rng.choice(persons), "maker", "work")
        both(artifact, rng.choice(buildings), "holder", "exhibit")
        both(artifact, rng.choice(organisms), "subject", "depiction")
        link(artifact, rng.choice(cities), "origin")

    _share_names(config, rng, persons, pages, cities)
    _nicknames(config, rng, persons, pages, names)
    _lists_and_categories(buildings, organisms, artifacts, pages)
    _images(config, rng, pages)
    for pid, degree in compute_in_degrees(pages).items():
        pages[pid].in_degree = degree
    return list(pages.values())


def _share_names(
    config: WorldConfig, rng: random.Random, persons: list[Page], pages: dict[str, Page], cities: list[Page]
) -> None:
    """Pairs of persons that share a name: titles get a qualifier, a disambiguation page lists both."""
    for index in range(config.shared_names):
        first, second = persons[2 * index], persons[2 * index + 1]
        shared = first.title
        renamed = []
        for person in (first, second):
            old_id = person.id
            person.title = f"{shared} ({person.infobox['occupation']})"
            if any(p.title == person.title for p in renamed):
                person.title = f"{shared} ({person.infobox['birth date'][-4:]})"
            person.id = page_id(person.title)
            person.aliases.append(shared)
            del pages[old_id]
            pages[person.id] = person
            renamed.append(person)
            for page in pages.values():
                page.links = [
                    Link(person.id, link.relation, shared) if link.target == old_id else link for link in page.links
                ]
        title = f"{shared} (disambiguation)"
        pages[page_id(title)] = Page(
            id=page_id(title),
            title=title,
            disambiguation=True,
            links=[Link(p.id, "may refer to", p.title) for p in renamed],
        )
        rng.choice(cities).links.append(Link(page_id(title), "notable resident", shared))


def _nicknames(
    config: WorldConfig, rng: random.Random, persons: list[Page], pages: dict[str, Page], names: _Names
) -> None:
    """Nicknames become aliases plus redirect pages; some links reach the person via the redirect."""
    used: set[str] = set()
    for person in persons:
        if rng.random() >= config.nickname_fraction:
            continue
        nickname = f"The {rng.choice(_NICK_ADJ)} {rng.choice(_NICK_NOUN)}"
        if nickname in used:
            nickname = f"The {names.word((2, 2))} {rng.choice(_NICK_NOUN)}"
        used.add(nickname)
        person.aliases.append(nickname)
        redirect = Page(id=page_id(nickname), title=nickname, redirect=person.id)
        pages[redirect.id] = redirect
        for page in list(pages.values()):
            page.links = [
                Link(redirect.id, link.relation, nickname)
                if link.target == person.id and rng.random() < config.redirect_link_fraction
                else link
                for link in page.links
            ]


def _lists_and_categories(
    buildings: list[Page], organisms: list[Page], artifacts: list[Page], pages: dict[str, Page]
) -> None:
    """ "List of ..." articles and Category pages: reachable by links, never by the walk."""
    for members in (buildings, organisms, artifacts):
        kinds = sorted({m.kind for m in members if m.kind})
        for kind in kinds:
            group = [m for m in members if m.kind == kind]
            title = f"List of {kind}s"
            pages[page_id(title)] = Page(
                id=page_id(title), title=title, links=[Link(m.id, "list entry", m.title) for m in group]
            )
            category = f"Category:{kind.capitalize()}s"
            pages[page_id(category)] = Page(
                id=page_id(category),
                title=category,
                namespace="Category",
                links=[Link(m.id, "member", m.title) for m in group],
            )
            for member in group:
                member.links.append(Link(page_id(title), "see also", title))
                member.links.append(Link(page_id(category), "category", category))


def image_caption(page: Page, relation: str | None = None, named: str | None = None) -> str:
    """An entity image's caption: its title and kind, and in a leaky caption one linked entity's name
    (the synthetic drills write the same form, so the two cannot drift apart)."""
    caption = f"{page.title}, a {page.kind}"
    return caption if relation is None else f"{caption}; {relation}: {named}"


def _images(config: WorldConfig, rng: random.Random, pages: dict[str, Page]) -> None:
    """Image references (rendered later) for every non-hub entity; some below the seed size rule."""
    for page in list(pages.values()):
        if page.domain not in VISUAL_DOMAINS or page.kind == "country":
            continue
        size = config.small_image_size if rng.random() < config.small_image_fraction else config.image_size
        caption, facts = image_caption(page), []
        typed = [link for link in page.links if link.relation in CAPTION_RELATIONS]
        if typed and rng.random() < config.leaky_caption_fraction:
            leak = rng.choice(typed)
            caption = image_caption(page, leak.relation, leak.anchor)
            facts.append([leak.relation, leak.target])
        file_page = f"File:{page.id}.png"
        page.images.append(
            ImageRef(file=f"images/{page.id}.png", width=size, height=size, caption=caption, facts=facts)
        )
        page.links.append(Link(file_page, "image", file_page))


CAPTION_RELATIONS = (
    "architect",
    "director",
    "maker",
    "holder",
    "describer",
    "keeper",
    "spouse",
    "birthplace",
    "mayor",
    "location",
    "founder",
    "subject",
    "origin",
)
