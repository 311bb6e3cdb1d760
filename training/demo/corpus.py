"""The built-in demo corpus: short stories, arithmetic and dialogues, generated from a seed.

Fathom ships no downloaded text. This grammar gives enough variety for a byte-level BPE tokenizer
to learn real merges and for a tiny model's loss to fall visibly within a few dozen steps, and it
is the same bytes on every machine, so runs that use it are reproducible.
"""

from __future__ import annotations

import random
from pathlib import Path

NAMES = (
    "Ada",
    "Bruno",
    "Chiara",
    "Dmitri",
    "Elif",
    "Farah",
    "Goran",
    "Hana",
    "Ines",
    "Jonas",
    "Kemal",
    "Lena",
    "Mateo",
    "Nora",
    "Oskar",
    "Priya",
    "Quentin",
    "Rosa",
    "Soren",
    "Tomas",
    "Uma",
    "Viktor",
    "Wen",
    "Yusuf",
    "Zora",
)
PLACES = (
    "the harbour",
    "the old mill",
    "the library",
    "the market square",
    "the lighthouse",
    "the orchard",
    "the train station",
    "the river bank",
    "the bakery",
    "the observatory",
    "the workshop",
    "the mountain hut",
    "the village school",
    "the greenhouse",
    "the ferry",
)
OBJECTS = (
    "a brass compass",
    "a loaf of rye bread",
    "a map of the coast",
    "a red umbrella",
    "a jar of honey",
    "a wooden flute",
    "a broken clock",
    "a letter with no stamp",
    "a basket of pears",
    "a lantern",
    "a notebook full of sums",
    "a kite",
    "a spool of wire",
    "a telescope",
    "a pair of boots",
    "a sack of flour",
    "a violin",
    "a chess set",
)
ACTIONS = (
    "carried",
    "repaired",
    "found",
    "painted",
    "sold",
    "borrowed",
    "hid",
    "measured",
    "wrapped",
    "weighed",
    "cleaned",
    "returned",
    "sketched",
    "counted",
)
WEATHER = (
    "It was raining",
    "The sun was low",
    "Fog rolled in from the sea",
    "Snow covered the roofs",
    "A warm wind blew",
    "The sky was clear",
    "Thunder rumbled far away",
    "The morning was cold",
)
FEELINGS = ("happy", "tired", "curious", "worried", "proud", "surprised", "calm", "restless")
ENDINGS = (
    "and walked home before dark.",
    "and wrote about it that evening.",
    "and nobody spoke of it again.",
    "and laughed about it for days.",
    "and promised to come back in spring.",
    "and went to sleep early.",
)
QUESTIONS = (
    ("What is the capital of a country?", "It is the city where the government usually meets."),
    ("Why is the sky blue?", "Air scatters blue light more than red light, so blue reaches us from every direction."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("What does a compass show?", "A compass shows which way is north."),
    ("How do plants get energy?", "Plants use sunlight to turn water and carbon dioxide into sugar."),
    ("What is a prime number?", "A prime number has exactly two divisors: one and itself."),
    ("Why do ships float?", "A ship pushes aside water that weighs as much as the ship itself."),
    ("What is rain made of?", "Rain is water that condensed in clouds and fell as drops."),
)


def _story(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    place, other_place = rng.sample(PLACES, 2)
    thing = rng.choice(OBJECTS)
    sentences = [
        f"{rng.choice(WEATHER)} when {a} arrived at {place}.",
        f"{a} {rng.choice(ACTIONS)} {thing} and felt {rng.choice(FEELINGS)}.",
        f"Later {b} came from {other_place} with {rng.choice(OBJECTS)}.",
    ]
    if rng.random() < 0.6:
        n = rng.randint(2, 12)
        sentences.append(f"Together they {rng.choice(ACTIONS)} {n} more things, one by one.")
    if rng.random() < 0.5:
        sentences.append(f'"Look at this," said {b}, and {a} looked for a long time.')
    sentences.append(f"{a} thanked {b} {rng.choice(ENDINGS)}")
    return " ".join(sentences)


def _arithmetic(rng: random.Random) -> str:
    x, y = rng.randint(0, 99), rng.randint(0, 99)
    op = rng.choice(("plus", "minus", "times"))
    value = {"plus": x + y, "minus": x - y, "times": x * y}[op]
    return f"{x} {op} {y} is {value}. " + ("Check: " + str(value) + "." if rng.random() < 0.3 else "")


def _dialogue(rng: random.Random) -> str:
    question, answer = rng.choice(QUESTIONS)
    return f"User: {question}\nAssistant: {answer}"


def generate(n_documents: int = 6000, seed: int = 0) -> str:
    """Documents separated by blank lines; the same text for the same arguments."""
    rng = random.Random(seed)
    makers = (_story, _story, _story, _arithmetic, _dialogue)
    return "\n\n".join(rng.choice(makers)(rng).strip() for _ in range(n_documents)) + "\n"


def write(path: Path, n_documents: int = 6000, seed: int = 0) -> Path:
    """Writes the corpus to `path` (atomically) unless it is already there."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(generate(n_documents, seed), encoding="utf-8")
        tmp.replace(path)
    return path
