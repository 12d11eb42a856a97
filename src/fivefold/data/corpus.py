"""The built-in corpus: short English-like stories from a small grammar, the same text on every machine.

Generated rather than shipped, so the package stays small and the text is free of any licence. It has
what a tiny byte-level model can learn in a few dozen steps: frequent words, spelling, capitals after a
full stop, quotes, and names that recur inside a story.
"""

from __future__ import annotations

import random
from functools import lru_cache

NAMES = [("Mia", "she"), ("Tom", "he"), ("Ada", "she"), ("Sam", "he"), ("Lena", "she"), ("Omar", "he"),
         ("Rosa", "she"), ("Ben", "he"), ("Nora", "she"), ("Finn", "he"), ("Ivy", "she"), ("Leo", "he")]
PLACES = ["the old mill", "the market", "the river", "the library", "the harbour", "the garden",
          "the bakery", "the school", "the forest", "the hill", "the station", "the village square"]
THINGS = ["box", "letter", "key", "map", "book", "lamp", "coin", "bird", "cake", "boat", "clock", "kite"]
ADJECTIVES = ["small", "red", "old", "shiny", "heavy", "strange", "green", "tiny", "broken", "golden",
              "quiet", "bright"]
SPOTS = ["under the bridge", "behind the door", "near the well", "on the table", "in the grass",
         "beside the road", "at the top of the stairs", "inside a drawer"]
FEELINGS = ["happy", "surprised", "tired", "curious", "worried", "proud", "calm", "excited"]
PEOPLE = ["the baker", "the teacher", "the fisherman", "the mayor", "an old woman", "a young boy",
          "the guard", "the painter"]
TIMES = ["One morning", "Later that day", "In the evening", "After lunch", "Early the next day",
         "When the rain stopped", "At noon", "Before sunset"]
WEATHER = ["The sun was warm.", "It was raining softly.", "A cold wind blew from the sea.",
           "The sky was clear and blue.", "Fog covered the streets."]


def _story(rng: random.Random) -> str:
    hero, pronoun = rng.choice(NAMES)
    friend, _ = rng.choice([n for n in NAMES if n[0] != hero])
    thing, adjective = rng.choice(THINGS), rng.choice(ADJECTIVES)
    place, other_place = rng.sample(PLACES, 2)
    person = rng.choice(PEOPLE)
    subject = pronoun.capitalize()
    sentences = [
        f"{rng.choice(TIMES)}, {hero} walked to {place}.",
        rng.choice(WEATHER),
        f"{subject} found a {adjective} {thing} {rng.choice(SPOTS)}.",
        f'"What is this?" {pronoun} asked.',
        f"{hero} showed the {thing} to {friend}.",
        f'"I think it belongs to {person}," said {friend}.',
        f"So they took the {thing} to {other_place}.",
        f"{person.capitalize()} was very {rng.choice(FEELINGS)} to see it again.",
        f"That night {hero} felt {rng.choice(FEELINGS)} and went to sleep early.",
    ]
    # Drop or keep a few middle sentences so stories differ in length and order of events.
    middle = [s for s in sentences[1:-1] if rng.random() < 0.85]
    return " ".join([sentences[0], *middle, sentences[-1]])


@lru_cache(maxsize=4)
def builtin_documents(stories: int = 4000, seed: int = 0) -> tuple[str, ...]:
    """The stories one by one: each is a document of its own when packed (--document-mask)."""
    rng = random.Random(seed)
    return tuple(_story(rng) for _ in range(stories))


@lru_cache(maxsize=4)
def builtin_corpus(stories: int = 4000, seed: int = 0) -> str:
    """About 300 characters a story; the default is ~1.2 MB of text. random.Random's choice, sample and
    random give the same sequence on every Python 3 version, so the text is the same everywhere."""
    return "\n\n".join(builtin_documents(stories, seed)) + "\n"
