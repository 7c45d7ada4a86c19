"""How people vary the same message: case, a shouted sentence, dropped punctuation, typos, a greeting and
sign-off, a message cut to its first sentence, another message's sentence tacked on.

One home for these edits because two places need them: the distilled student's corpus copies each
hand-written text with any of them (`distill.corpus`), and `pagoda laya-mini eval` measures how often an
answer survives the edits that keep a message's meaning (`SAME_MEANING`: the first five kinds; cutting and
appending may change it), which bounds how well a student taught on such copies can follow its teacher.
"""

from __future__ import annotations

import random

LOWER, SHOUT, NO_PUNCTUATION, TYPOS, GREETING, FIRST_SENTENCE, APPEND = range(7)
KINDS = (LOWER, SHOUT, NO_PUNCTUATION, TYPOS, GREETING, FIRST_SENTENCE, APPEND)
SAME_MEANING = (LOWER, SHOUT, NO_PUNCTUATION, TYPOS, GREETING)
EDIT_COPIES = 2    # edited copies per text when measuring whether an answer survives the edits
EDIT_SEED = 15     # fixed, so that every model and every report is measured on the same copies

GREETINGS = ["Hi,", "Hello,", "Hey", "Hi team,", "Dear support,", "Good morning,", "hello?", "To whom it may concern,"]
SIGN_OFFS = ["Thanks", "Thank you!", "Regards,\nSam", "Cheers", "Sent from my phone", "thx", "Best,\nA. Novak",
             "-- \nOps team"]


def typo(text: str, rng: random.Random) -> str:
    """Two letters of one word of 4+ letters swapped (60%) or one of them dropped."""
    words = text.split(" ")
    long = [i for i, w in enumerate(words) if len(w) >= 4 and w.isalpha()]
    if not long:
        return text
    i = rng.choice(long)
    w = words[i]
    j = rng.randrange(len(w) - 1)
    words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:] if rng.random() < 0.6 else w[:j] + w[j + 1:]
    return " ".join(words)


def sentences(text: str) -> list[str]:
    out, start = [], 0
    for i, ch in enumerate(text):
        if ch in ".!?" and (i + 1 == len(text) or text[i + 1] in " \n"):
            out.append(text[start:i + 1].strip())
            start = i + 1
    rest = text[start:].strip()
    return [s for s in out + ([rest] if rest else []) if s]


def perturb(text: str, rng: random.Random, pool: list[str], kinds: tuple[int, ...] = KINDS) -> str:
    """`text` with one to three distinct edits drawn from `kinds`; APPEND takes its sentence from `pool`."""
    for op in rng.sample(kinds, rng.randint(1, min(3, len(kinds)))):
        if op == LOWER:
            text = text.lower()
        elif op == SHOUT:
            parts = sentences(text)
            k = rng.randrange(len(parts))
            text = " ".join(p.upper() if i == k else p for i, p in enumerate(parts))
        elif op == NO_PUNCTUATION:
            text = "".join(ch for ch in text if ch not in ".,!?;:'\"")
        elif op == TYPOS:
            for _ in range(rng.randint(1, 2)):
                text = typo(text, rng)
        elif op == GREETING:
            text = f"{rng.choice(GREETINGS)}\n\n{text}\n\n{rng.choice(SIGN_OFFS)}"
        elif op == FIRST_SENTENCE:
            parts = sentences(text)
            text = parts[0] if parts else text
        else:
            text = f"{text} {rng.choice(sentences(rng.choice(pool)) or pool)}"
    return text


def same_meaning_copies(texts: list[str], copies: int = EDIT_COPIES, seed: int = EDIT_SEED) -> list[str]:
    """`copies` copies of each text in order (all of text 0's first), each with one to three `SAME_MEANING`
    edits. Both measures of "does the answer survive" (`pagoda laya-mini eval` and a student report's teacher
    row) draw them here, so for one file they edit the same copies; their figures differ only by the questions
    asked (the eval asks the README's billing questions, a report its task's)."""
    rng = random.Random(seed)
    return [perturb(x, rng, texts, SAME_MEANING) for x in texts for _ in range(copies)]
