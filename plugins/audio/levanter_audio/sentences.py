"""Simple English sentences to synthesize: a small vocabulary put together by a few patterns, so
that a small speech model can learn to recognize every word, and held-out sentences (other
draws) test whether it transcribes what it has not heard in that order.

``random_sentences(n, seed)`` gives the same ``n`` sentences for the same seed, in any process.
"""

from __future__ import annotations

import random

DETERMINERS = ("the", "a", "my", "your", "this", "that", "every", "one")
ADJECTIVES = (
    "big", "small", "red", "green", "blue", "old", "young", "happy", "quiet", "loud",
    "fast", "slow", "warm", "cold", "bright", "dark", "tall", "short", "soft", "brave",
)  # fmt: skip
NOUNS = (
    "cat", "dog", "bird", "fish", "horse", "child", "teacher", "farmer", "doctor", "king",
    "house", "garden", "river", "tree", "boat", "car", "book", "letter", "song", "window",
    "apple", "bread", "table", "chair", "door", "road", "city", "mountain", "friend", "baby",
)  # fmt: skip
VERBS = (
    "sees", "likes", "finds", "takes", "makes", "paints", "builds", "follows", "helps", "calls",
    "reads", "opens", "carries", "watches", "washes", "moves", "wants", "keeps", "sells", "draws",
)  # fmt: skip
INTRANSITIVE = ("sleeps", "runs", "sings", "waits", "laughs", "swims", "walks", "jumps", "falls", "smiles")
ADVERBS = ("today", "again", "slowly", "quickly", "at night", "in the morning", "every day", "once more")
PLACES = ("in the garden", "by the river", "near the house", "on the road", "under the tree", "in the city")


def _noun_phrase(rng: random.Random) -> str:
    words = [rng.choice(DETERMINERS)]
    if rng.random() < 0.6:
        words.append(rng.choice(ADJECTIVES))
    words.append(rng.choice(NOUNS))
    phrase = " ".join(words)
    return phrase.replace("a a", "an a").replace("a o", "an o")  # "an apple", "an old"


def sentence(rng: random.Random) -> str:
    """One sentence: a subject, a verb (with an object when it takes one), sometimes a place or
    a time."""
    subject = _noun_phrase(rng)
    if rng.random() < 0.7:
        predicate = f"{rng.choice(VERBS)} {_noun_phrase(rng)}"
    else:
        predicate = rng.choice(INTRANSITIVE)
    extra = ""
    roll = rng.random()
    if roll < 0.25:
        extra = " " + rng.choice(PLACES)
    elif roll < 0.45:
        extra = " " + rng.choice(ADVERBS)
    return f"{subject} {predicate}{extra}"


def random_sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` sentences drawn with ``seed``; the same arguments give the same list."""
    rng = random.Random(seed)
    return [sentence(rng) for _ in range(n)]


def vocabulary() -> set[str]:
    """Every word a sentence can hold."""
    words: set[str] = {"an"}
    for group in (DETERMINERS, ADJECTIVES, NOUNS, VERBS, INTRANSITIVE, ADVERBS, PLACES):
        for item in group:
            words.update(item.split())
    return words
