"""Hand-made graphs: one that trips every sampling rule, and the paper's running example (App. D.2)."""

from __future__ import annotations

from osvl.world.graph import Graph, ImageRef, Link, Page

BIG = [ImageRef("x.png", 600, 600, "")]


def rules_graph() -> Graph:
    """Seed Zoo_A: its only walkable link goes through a redirect to Keeper; the rest are traps."""
    pages = [
        Page(
            id="Zoo_A",
            title="Zoo A",
            domain="Building/Place",
            kind="zoo",
            infobox={"opened": "1970"},
            images=BIG,
            in_degree=60,
            links=[
                Link("Big_Country", "country"),
                Link("Zoo_(disambiguation)", "see"),
                Link("List_of_zoos", "list"),
                Link("Category:Zoos", "category"),
                Link("File:Zoo.png", "image"),
                Link("Ghost_Page", "ghost"),
                Link("Keeper_Nick", "keeper"),
            ],
        ),
        Page(
            id="Big_Country",
            title="Big Country",
            domain="Location",
            kind="country",
            infobox={"population": "9000000"},
            images=BIG,
            in_degree=20_000,
        ),
        Page(id="Zoo_(disambiguation)", title="Zoo (disambiguation)", disambiguation=True, in_degree=1),
        Page(id="List_of_zoos", title="List of zoos", in_degree=1),
        Page(id="Category:Zoos", title="Category:Zoos", namespace="Category"),
        Page(id="Keeper_Nick", title="Keeper Nick", redirect="Keeper"),
        Page(
            id="Keeper",
            title="Keeper",
            domain="Person",
            kind="person",
            in_degree=2,
            infobox={"occupation": "zookeeper"},
            links=[Link("Zoo_A", "employer"), Link("Spouse", "spouse")],
        ),
        Page(
            id="Spouse",
            title="Spouse Person",
            domain="Person",
            kind="person",
            in_degree=1,
            infobox={"citizenship date": "1 May 2000", "motto": "one two three four five six seven"},
            links=[Link("Keeper", "spouse")],
        ),
        Page(
            id="Small_Image_Tower",
            title="Small Image Tower",
            domain="Building/Place",
            kind="tower",
            infobox={"height m": "30"},
            images=[ImageRef("s.png", 300, 300, "")],
            in_degree=60,
        ),
        Page(id="Bare_Beetle", title="Bare Beetle", domain="Organism", kind="beetle", images=BIG, in_degree=60),
        Page(
            id="Quiet_Vase",
            title="Quiet Vase",
            domain="Artifact",
            kind="vase",
            infobox={"material": "jade"},
            images=BIG,
            in_degree=3,
        ),
        Page(
            id="Loud_Vase",
            title="Loud Vase",
            domain="Artifact",
            kind="vase",
            infobox={"material": "oak"},
            images=BIG,
            in_degree=70,
        ),
    ]
    return Graph({p.id: p for p in pages})


def australia_zoo_graph() -> Graph:
    """Australia_Zoo -> Steve_Irwin -> Terri_Irwin with the distractors of the paper's Table 6."""
    person = {"domain": "Person", "kind": "person"}
    children = [Link("Steve_Irwin", "child"), Link("Joy_Irwin", "child"), Link("Mandy_Irwin", "child")]
    pages = [
        Page(
            id="Australia_Zoo",
            title="Australia Zoo",
            domain="Building/Place",
            kind="zoo",
            aliases=["Queensland Reptile and Fauna Park"],
            infobox={"opened": "1970"},
            in_degree=400,
            images=[ImageRef("images/Australia_Zoo.png", 800, 600, "Australia Zoo entrance")],
            links=[
                Link("Bob_Irwin", "founder"),
                Link("Lyn_Irwin", "founder"),
                Link("Bob_Irwin", "manager"),
                Link("The_Crocodile_Hunter", "manager"),
                Link("Queensland", "location"),
            ],
        ),
        Page(id="Queensland", title="Queensland", domain="Location", kind="state", in_degree=50_000),
        Page(id="Bob_Irwin", title="Bob Irwin", infobox={"management start": "1970"}, links=children, **person),
        Page(id="Lyn_Irwin", title="Lyn Irwin", infobox={"management start": "1970"}, links=children, **person),
        Page(
            id="Steve_Irwin",
            title="Steve Irwin",
            aliases=["The Crocodile Hunter"],
            **person,
            infobox={
                "occupation": "wildlife documentary host",
                "death year": "2006",
                "management start": "1991",
                "nickname": "Crocodile Hunter",
            },
            links=[Link("Terri_Irwin", "spouse")],
        ),
        Page(id="The_Crocodile_Hunter", title="The Crocodile Hunter (person)", redirect="Steve_Irwin"),
        Page(
            id="Terri_Irwin",
            title="Terri Irwin",
            infobox={"citizenship date": "17 November 2009"},
            links=[Link("Steve_Irwin", "spouse")],
            **person,
        ),
        Page(id="Joy_Irwin", title="Joy Irwin", infobox={"management start": "none"}, **person),
        Page(id="Mandy_Irwin", title="Mandy Irwin", **person),
    ]
    return Graph({p.id: p for p in pages})
