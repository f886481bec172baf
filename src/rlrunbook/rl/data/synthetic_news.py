"""A summarization data set rlrunbook generates itself: local news articles with known key facts.

It is what ``--env summary`` trains on when the real CNN/DailyMail set is neither in ``../shared/data``
nor reachable on the hub (see ``rl.rollout.tasks.SummaryTask``), so the main job runs anywhere. Every word comes
from the templates and word lists below, written for this project: no third-party text.

Each article reports one event (a bridge reopening, storm damage, a plant closing, a council vote, ...)
in a fictional town: a lead sentence with the key facts (who, what, where, the numbers), details, a
quote, background and reactions, in 177-211 words (the prompt keeps the first 150, as of a real
article), in the order and register of a wire report. Its ``highlights`` restate the key facts in 3-4
sentences (41 words on average; CNN/DailyMail's: 53). The rewards behave as on real articles (docs/data.md
compares them); ``rouge`` has references to match.

Deterministic: ``synthetic_news(n, seed)`` is a pure function, and a smaller ``n`` gives a prefix.
"""

from __future__ import annotations

import random

from rlrunbook.rl.data.records import SummaryRecord

NAME = "synthetic_news"
VERSION = 1

TOWNS = ["Alderbrook", "Marrowfield", "Eastholm", "Kestrel Bay", "Pinecrest", "Larkspur", "Oakhaven", "Millbridge",
         "Stonehurst", "Wrenford", "Hollowmere", "Brackenridge", "Fernley", "Ashcombe", "Greywater", "Harlow Point",
         "Juniper Falls", "Redcliffe", "Saltmarsh", "Tamsworth", "Upton Vale", "Westerly", "Briarton", "Copperhill"]
REGIONS = ["the northern valley", "the coastal district", "the lake country", "the river delta", "the high plains",
           "the eastern hills"]
FIRST = ["Maria", "James", "Aisha", "Tomas", "Helen", "Ravi", "Grace", "Daniel", "Lena", "Samuel", "Noor", "Peter",
         "Ingrid", "Kwame", "Rosa", "Victor", "Mei", "Oliver", "Fatima", "George", "Elena", "Marcus", "Yuki", "Ruth"]
LAST = ["Calloway", "Okafor", "Lindqvist", "Moreno", "Hartley", "Nakamura", "Brennan", "Osei", "Whitfield",
        "Delacroix", "Petrov", "Ashworth", "Mbeki", "Thornton", "Sandoval", "Kowalski", "Farrell", "Haddad"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]

# One template per kind of event. {slots} are filled from the facts drawn for the article; "lead", "details"
# and "quote" carry the key facts, "highlights" restates them.
EVENTS = [
    {"facts": {"cost": (2, 40, " million dollars"), "months": (3, 18, ""), "vehicles": (4000, 30000, "")},
     "lead": "The {town} river bridge reopened to traffic on {day} after {months} months of repairs that cost "
             "{cost}, officials said.",
     "details": ["Engineers replaced the rusted steel supports and laid a new deck wide enough for a cycle lane.",
                 ("Before the closure about {vehicles} vehicles crossed the bridge each day, and drivers faced "
                  "detours of up to forty minutes."),
                 "Shops near the old crossing said trade fell sharply while the road was shut."],
     "quote": "\"We asked people to be patient for a long time, and today they get a safer bridge,\" said {person}, "
              "the {role} of {town}.",
     "roles": ["mayor", "county engineer", "transport director"],
     "highlights": "The {town} river bridge reopened on {day} after {months} months of repairs costing {cost}. "
                   "About {vehicles} vehicles a day used the bridge before it closed. {person} said residents "
                   "now have a safer crossing."},
    {"facts": {"homes": (40, 900, ""), "outages": (1500, 40000, ""), "wind": (70, 160, " kilometres per hour")},
     "lead": "A storm with winds of up to {wind} damaged {homes} homes in {town} overnight and left {outages} "
             "households without power, emergency services said on {day}.",
     "details": ["Fallen trees blocked several roads and a school roof was torn off near the town centre.",
                 "Crews worked through the night to restore electricity, starting with the hospital and care homes.",
                 "No one was seriously hurt, although two people were treated for minor injuries."],
     "quote": "\"The damage is worse than anything we have seen here in twenty years,\" said {person}, the {role}.",
     "roles": ["fire chief", "emergency coordinator", "mayor"],
     "highlights": "A storm with winds up to {wind} damaged {homes} homes in {town}. {outages} households lost "
                   "power overnight. {person} said it was the worst damage in twenty years."},
    {"facts": {"jobs": (80, 1200, ""), "years": (12, 90, "")},
     "lead": "{company}, which has made farm machinery in {town} for {years} years, will close its plant in "
             "{month}, putting {jobs} jobs at risk, the company announced on {day}.",
     "details": ["Managers blamed rising costs and falling orders from abroad for the decision.",
                 ("The plant is the largest employer in {region}, and many families have worked there for "
                  "generations."),
                 "Union leaders said they would ask the company to keep part of the site open."],
     "quote": "\"This is a hard day for every worker and for the whole town,\" said {person}, a {role}.",
     "roles": ["union representative", "council member", "local business owner"],
     "highlights": "{company} will close its {town} plant in {month}, putting {jobs} jobs at risk. The plant has "
                   "operated for {years} years. {person} called it a hard day for the town."},
    {"facts": {"cost": (5, 80, " million dollars"), "beds": (20, 240, "")},
     "lead": "A new wing of {town} General Hospital with {beds} beds opened on {day}, ending years of crowded "
             "wards, hospital managers said.",
     "details": ["The wing cost {cost} and includes a children's unit and a larger emergency department.",
                 "Patients from across {region} had waited hours for a bed during the busiest winters.",
                 "Nurses said the new rooms would make it easier to keep infections from spreading."],
     "quote": "\"Our staff finally have the space they need to care for people properly,\" said {person}, the "
              "{role}.",
     "roles": ["hospital director", "head nurse", "health minister"],
     "highlights": "{town} General Hospital opened a new wing with {beds} beds. The wing cost {cost}. {person} "
                   "said staff finally have the space they need."},
    {"facts": {"votes_for": (5, 9, ""), "votes_against": (1, 4, ""), "cost": (1, 25, " million dollars")},
     "lead": "The {town} council voted {votes_for} to {votes_against} on {day} to build a public swimming pool, "
             "a project expected to cost {cost}.",
     "details": ["Supporters said children in {region} have nowhere safe to learn to swim.",
                 "Opponents argued that the money should go to repairing roads and the town library.",
                 "Construction is due to begin in {month} and take about two years."],
     "quote": "\"A pool is not a luxury when the lake is the only place to swim,\" said {person}, a {role}.",
     "roles": ["council member", "school principal", "parent"],
     "highlights": "The {town} council voted {votes_for} to {votes_against} to build a public pool costing "
                   "{cost}. Work is due to start in {month}. {person} said the lake was the only place to swim."},
    {"facts": {"visitors": (8000, 90000, ""), "years": (10, 60, "")},
     "lead": "A record {visitors} people came to the {town} harvest festival this weekend, organisers said on "
             "{day}, the most in its {years} years.",
     "details": ["Farmers sold apples, cheese and bread from stalls along the main street.",
                 "A parade of tractors and a brass band opened the festival on Saturday morning.",
                 "Hotels in {region} were fully booked, and extra buses ran from the nearest city."],
     "quote": "\"We never expected so many visitors, and the volunteers did an amazing job,\" said {person}, the "
              "{role}.",
     "roles": ["festival director", "volunteer coordinator", "mayor"],
     "highlights": "A record {visitors} people attended the {town} harvest festival. The festival has run for "
                   "{years} years. {person} praised the volunteers."},
    {"facts": {"households": (300, 12000, ""), "days": (2, 14, "")},
     "lead": "Health officials told {households} households in {town} to boil their tap water for at least "
             "{days} days after tests found bacteria in the supply, the water authority said on {day}.",
     "details": ["The problem was traced to a broken valve at the treatment works near the river.",
                 "Bottled water is being handed out at the town hall and two schools.",
                 "Officials said no illnesses had been reported so far."],
     "quote": "\"Please boil all water used for drinking or cooking until we tell you it is safe,\" said "
              "{person}, the {role}.",
     "roles": ["water authority spokesperson", "health officer", "mayor"],
     "highlights": "{households} households in {town} were told to boil tap water for {days} days. Tests found "
                   "bacteria after a valve broke. {person} urged residents to boil all drinking water."},
    {"facts": {"percent": (12, 60, " percent"), "people": (200, 5000, "")},
     "lead": "Researchers at the University of {town} found that a daily walk cut the risk of falls among older "
             "adults by {percent}, in a study of {people} people published on {day}.",
     "details": ["Participants walked for thirty minutes a day for one year while the team recorded their balance.",
                 "Those who walked also reported sleeping better and feeling less lonely.",
                 "The team now plans a larger trial across {region}."],
     "quote": "\"A simple habit made a real difference to people's lives,\" said {person}, the {role} who led "
              "the study.",
     "roles": ["professor", "university researcher", "lead scientist"],
     "highlights": "A University of {town} study of {people} people found daily walks cut falls by {percent}. "
                   "Walkers also slept better. {person} led the study."},
    {"facts": {"score_a": (2, 6, ""), "score_b": (0, 1, ""), "years": (15, 70, "")},
     "lead": "{town} Rovers won the regional football championship on {day} with a {score_a}-{score_b} victory, "
             "their first title in {years} years.",
     "details": ["The winning goal came from a header in the last minutes of the first half.",
                 "Thousands of fans filled the streets of {town} after the final whistle.",
                 "The club, run mostly by volunteers, almost folded for lack of money five years ago."],
     "quote": "\"These players never stopped believing, even when nobody gave us a chance,\" said {person}, the "
              "{role}.",
     "roles": ["team coach", "club chairman", "captain"],
     "highlights": "{town} Rovers won the regional championship {score_a}-{score_b}. It is their first title in "
                   "{years} years. {person} said the players never stopped believing."},
    {"facts": {"animals": (20, 400, ""), "volunteers": (15, 200, "")},
     "lead": "Volunteers rescued {animals} seabirds covered in oil on the beaches near {town} after a cargo ship "
             "leaked fuel, the wildlife trust said on {day}.",
     "details": ["About {volunteers} people helped wash the birds with warm water and soap.",
                 "The coast guard said the leak had been stopped and the ship towed to port.",
                 "Experts warned that more oil could wash ashore in {region} over the coming week."],
     "quote": "\"Every bird we save matters, and the help from local people has been incredible,\" said {person}, "
              "the {role}.",
     "roles": ["wildlife trust manager", "park ranger", "veterinarian"],
     "highlights": "Volunteers rescued {animals} oil-covered seabirds near {town} after a ship leaked fuel. About "
                   "{volunteers} people helped clean the birds. {person} thanked local people."},
]
BACKGROUND = [
    "{town} is home to about {population} people and lies in {region}.",
    "The town grew around a railway station built more than a century ago.",
    "Local officials have struggled to balance the budget since the last recession.",
    "Many younger residents have moved to larger cities in search of work.",
    "The regional government said it was following the situation closely.",
    "Residents were invited to a public meeting at the town hall next week.",
    "A spokesperson for the county said more information would be published online.",
    "Similar problems have been reported in other towns across {region} this year.",
    "The last time the town made national headlines was during the great flood of its early years.",
    "Census figures show that the number of families with young children has risen slowly since then.",
    "The town council meets on the first {day} of every month in the old courthouse.",
    "Tourism has become more important to the local economy as farming has declined.",
]
REACTIONS = [
    "Some residents welcomed the news, while others said they wanted more answers.",
    "Neighbours shared photographs and updates on social media throughout the day.",
    "Opposition members called for an independent review of how the matter was handled.",
    "Business owners said they hoped life in {town} would return to normal soon.",
    "A local newspaper collected hundreds of letters from readers within a few hours.",
    "Church leaders offered the use of their halls to anyone who needed help.",
]


def synthetic_news_name() -> str:
    """The set's name and version, as ``run_metadata.json`` records it under ``dataset.source``."""
    return f"{NAME}-v{VERSION}"


def _draw(rng: random.Random, low: int, high: int, unit: str) -> str:
    value = rng.randint(low, high)
    return f"{value:,}{unit}"


def _article(rng: random.Random) -> tuple[str, str]:
    event = rng.choice(EVENTS)
    town = rng.choice(TOWNS)
    slots = {"town": town, "region": rng.choice(REGIONS), "day": rng.choice(WEEKDAYS), "month": rng.choice(MONTHS),
             "person": f"{rng.choice(FIRST)} {rng.choice(LAST)}", "role": rng.choice(event["roles"]),
             "company": f"{rng.choice(LAST)} Engineering", "population": f"{rng.randint(4, 90) * 1000:,}"}
    slots.update({name: _draw(rng, *spec) for name, spec in event["facts"].items()})
    details = list(event["details"])
    rng.shuffle(details)
    background = [BACKGROUND[0], *rng.sample(BACKGROUND[1:], 5)]  # the town's size is a key fact (highlights)
    rng.shuffle(background)
    reactions = rng.sample(REACTIONS, 2)
    # Wire-report order: the lead with the key facts, details, a quote, then background and reactions.
    paragraphs = [event["lead"], *details[:2], event["quote"], *background[:3], reactions[0], details[2],
                  *background[3:], reactions[1]]
    article = " ".join(p.format(**slots) for p in paragraphs)
    highlights = f"{event['highlights']} {BACKGROUND[0]}".format(**slots)  # + the town's size and region
    return article, highlights


def synthetic_news(n: int = 200, seed: int = 0) -> list[SummaryRecord]:
    """``n`` generated articles with highlights (ids ``synth-news-<seed>-<i>``), deterministic in ``seed``."""
    rng = random.Random(f"{NAME}-v{VERSION}-{seed}")
    records = []
    for i in range(n):
        article, highlights = _article(rng)
        records.append(SummaryRecord(id=f"synth-news-{seed}-{i}", document=article, highlights=highlights))
    return records
