"""`laya.corpus.noise`: the edits that keep a message's meaning never cut it or borrow from another message,
the others do what they say, and a seed gives the same copy."""

import random
import string

from laya.corpus import noise

TEXT = "My invoice for March is wrong. We were charged for 12 seats, not 9. Please fix it before Friday."
OTHER = "Zebras escaped from the zoo yesterday."


def words(text: str) -> list[str]:
    return "".join(ch for ch in text.lower() if ch not in string.punctuation).split()


def test_same_meaning_edits_keep_every_sentence_and_borrow_nothing():
    original = words(TEXT)
    rng = random.Random(0)
    for _ in range(300):
        copy = noise.perturb(TEXT, rng, [TEXT, OTHER], noise.SAME_MEANING)
        assert "zebras" not in copy.lower()
        kept = words(copy)
        # a typo or two changes at most two words; greetings and sign-offs only add words
        missing = [w for w in original if w not in kept]
        assert len(missing) <= 2, (copy, missing)


def test_each_kind_does_what_it_names():
    rng = random.Random(1)
    assert noise.perturb(TEXT, rng, [OTHER], (noise.LOWER,)) == TEXT.lower()
    assert noise.perturb(TEXT, rng, [OTHER], (noise.FIRST_SENTENCE,)) == "My invoice for March is wrong."
    assert noise.perturb(TEXT, rng, [OTHER], (noise.APPEND,)) == f"{TEXT} {OTHER}"
    assert not set(noise.perturb(TEXT, rng, [OTHER], (noise.NO_PUNCTUATION,))) & set(".,!?;:'\"")
    greeted = noise.perturb(TEXT, rng, [OTHER], (noise.GREETING,)).split("\n\n")
    assert greeted[0] in noise.GREETINGS and greeted[1] == TEXT and greeted[2] in noise.SIGN_OFFS
    shouted = noise.perturb(TEXT, rng, [OTHER], (noise.SHOUT,))
    assert shouted != TEXT and shouted.lower() == TEXT.lower()


def test_a_seed_gives_the_same_copies():
    a = [noise.perturb(TEXT, random.Random(7), [OTHER]) for _ in range(3)]
    assert a == [noise.perturb(TEXT, random.Random(7), [OTHER])] * 3
    draws = random.Random(3)
    assert len({noise.perturb(TEXT, draws, [OTHER]) for _ in range(50)}) > 10
