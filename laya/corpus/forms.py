"""Labelled items -> decision examples (`{"state", "questions", "labels", "source"}`) in many question forms.

The same fact is asked as a choice (which of these describes it?), a noul (is this about X?) and a
score (how severe?), with random option subsets, with and without descriptions, under several
phrasings and label wordings. The point is that the head learns to read the options it is given:
a model that memorised "billing is option 0" or "the answer word is 'billing'" fails here.
"""

from __future__ import annotations

import random

from laya.corpus import dialogs, tickets

# Wordings of each department; the first is the canonical label.
DEPARTMENT_NAMES = {
    "billing": ("billing", "payments", "billing and payments", "finance"),
    "technical": ("technical", "tech support", "technical issue", "bugs"),
    "shipping": ("shipping", "delivery", "orders and delivery", "logistics"),
    "account": ("account", "account management", "login and profile", "user account"),
    "other": ("other", "general", "something else", "miscellaneous"),
    "security": ("security", "account security", "fraud and security"),
    "sales": ("sales", "new business", "pricing and quotes"),
}
DEPARTMENT_DESCRIPTIONS = {
    "billing": ("invoices, payments, refunds", "charges, invoices and refunds", "money the customer paid or was charged"),
    "technical": ("bugs, outages, system errors", "the product is broken or crashing", "errors, crashes and bugs"),
    "shipping": ("deliveries, tracking, returns", "orders that are late, lost or damaged", "parcels and delivery"),
    "account": ("login, password, profile settings", "access to the account and its settings", "users, passwords and profiles"),
    "other": ("everything else", "anything not covered by the other options", "none of the above"),
    "security": ("hacked accounts, phishing, data protection", "fraud, break-ins and security questions"),
    "sales": ("quotes, demos and upgrades for new customers", "buying more licences or enterprise pricing"),
}
_DEPT_INSTRUCTIONS = ("Which department should handle this ticket?", "Route this ticket to a team.",
                      "department", "Which team is responsible?", "What is this ticket about?",
                      "Which of these describes the request?", "Classify the customer message by department.")
_URGENCY_SCALES = (("not urgent", "soon", "blocking"), ("low", "medium", "high"),
                   ("can wait", "should be handled this week", "needs action today"),
                   ("routine", "important", "critical"))
_URGENCY_INSTRUCTIONS = ("How urgent is this ticket?", "urgency", "How quickly must support act?",
                         "How severe is the problem for the customer?", "Rate the urgency of this request.")
_CHURN_INSTRUCTIONS = ("Does the user threaten to cancel or leave?", "Is the customer at risk of churning?",
                       "Is the customer threatening to cancel?", "churn risk",
                       "Does the customer say they might stop using the service?")
_SENTIMENT_NAMES = {"negative": ("negative", "unhappy", "angry or upset"), "neutral": ("neutral", "matter-of-fact", "calm"),
                    "positive": ("positive", "happy", "satisfied")}
_SENTIMENT_INSTRUCTIONS = ("What is the customer's mood?", "sentiment", "How does the customer feel?",
                           "Which tone does the message have?")

_REVIEW_NAMES = (("positive", "negative"), ("liked it", "disliked it"), ("fresh", "rotten"),
                 ("recommends the film", "does not recommend the film"), ("good review", "bad review"))
_REVIEW_INSTRUCTIONS = ("What is the sentiment of this review?", "sentiment", "Did the critic like the movie?",
                        "Classify the review.", "Which of these describes the critic's verdict?")
_REVIEW_NOUL = (("Does the reviewer like the film?", True), ("Is this review negative?", False),
                ("Would the critic recommend this movie?", True), ("Is the critic disappointed?", False))
_PLOT_NAMES = (("plot summary", "opinion"), ("story description", "critic's judgement"),
               ("synopsis", "review"))

_TOPIC_INSTRUCTIONS = ("What is this conversation about?", "topic", "Which of these topics fits the dialog best?",
                       "Pick the subject of the chat.", "Which category does this exchange belong to?")


_OPAQUE_FORMS = ("option {a}", "{a}", "queue {n}", "team {n}", "route {n}", "group {a}", "class {n}", "Q{n}",
                 "T-{c}", "bucket {c}")


def opaque_names(k: int, rng: random.Random) -> list[str]:
    """`k` option names that say nothing of what the options mean (letters, numbers, codes), in one style.

    Why: every label the corpus and the intents write carries its meaning in its name, and descriptions only
    repeat it, so a head trained on them routes by name and hardly reads a description: with the support-triage
    departments renamed "desk A/B/C", round 6 routed 0.51 of the dev tickets right, against 0.85 by name
    (docs/laya-mini-log.md, R24). A row whose only meaning is in its descriptions teaches reading them: round 7,
    whose stage named half its choices so, routes 0.67 (R25)."""
    form = rng.choice(_OPAQUE_FORMS)
    codes = rng.sample(range(100, 1000), k)
    return [form.format(a=chr(ord("A") + i), n=i + 1, c=codes[i]) for i in range(k)]


def _choice(instructions: str, options: list[tuple[str, str]], gold: str, rng: random.Random,
            p_descriptions: float = 0.5, p_opaque: float = 0.0) -> tuple[dict, str]:
    """A choice over `options` [(label, description)] in random order; descriptions on or off as a whole. With
    `p_opaque`, the labels are replaced by `opaque_names` and the descriptions always shown (0 draws nothing, so
    corpora built before it are unchanged)."""
    options = list(options)
    rng.shuffle(options)
    if p_opaque and rng.random() < p_opaque and all(desc for _, desc in options):
        names = opaque_names(len(options), rng)
        gold = names[[label for label, _ in options].index(gold)]
        return {"type": "choice", "instructions": instructions,
                "criteria": {name: desc for name, (_, desc) in zip(names, options)}}, gold
    if rng.random() < p_descriptions:
        criteria: dict | list = {label: desc for label, desc in options}
    else:
        criteria = [label for label, _ in options]
    return {"type": "choice", "instructions": instructions, "criteria": criteria}, gold


def _noul(instructions: str, truth: bool, rng: random.Random) -> tuple[dict, bool]:
    q: dict = {"type": "noul", "instructions": instructions}
    r = rng.random()
    if r < 0.15:
        q["labels"] = rng.choice(({"false": "no", "true": "yes"}, {"false": "B", "true": "A"},
                                  {"false": "unlikely", "true": "likely"}))
    elif r < 0.25:
        q["criteria"] = {"false": "no, it does not", "true": "yes, it does"}
    return q, truth


def _score(instructions: str, levels: tuple[str, ...], gold: int) -> tuple[dict, int]:
    return {"type": "score", "instructions": instructions, "criteria": list(levels)}, gold


def ticket_questions(t: dict, rng: random.Random, pool: tuple[str, ...],
                     p_opaque: float = 0.0) -> list[tuple[dict, object]]:
    """Questions about one ticket; department options come from `pool` (training or held-out label set), with
    `p_opaque` of them named by `opaque_names`."""
    out = []
    if rng.random() < 0.85:
        dept = t["department"]
        others = [d for d in pool if d != dept]
        k = rng.randint(1, min(5, len(others)))
        chosen = rng.sample(others, k)
        if dept != "other" and "other" in pool and rng.random() < 0.25:
            # The gold department is absent and a catch-all is present: the answer is the catch-all.
            chosen = [d for d in chosen if d != "other"][: max(1, k - 1)] + ["other"]
            gold = "other"
        else:
            chosen.append(dept)
            gold = dept
        names = {d: rng.choice(DEPARTMENT_NAMES[d]) for d in chosen}
        opts = [(names[d], rng.choice(DEPARTMENT_DESCRIPTIONS[d])) for d in chosen]
        out.append(_choice(rng.choice(_DEPT_INSTRUCTIONS), opts, names[gold], rng, p_opaque=p_opaque))
    if rng.random() < 0.7:
        out.append(_score(rng.choice(_URGENCY_INSTRUCTIONS), rng.choice(_URGENCY_SCALES), t["urgency"]))
    if rng.random() < 0.7:
        out.append(_noul(rng.choice(_CHURN_INSTRUCTIONS), t["churn"], rng))
    extra = rng.random()
    if extra < 0.25:
        names = {s: rng.choice(v) for s, v in _SENTIMENT_NAMES.items()}
        out.append(_choice(rng.choice(_SENTIMENT_INSTRUCTIONS), [(n, "") for n in names.values()],
                           names[t["sentiment"]], rng, p_descriptions=0.0))
    elif extra < 0.5:
        dept = t["department"] if rng.random() < 0.5 else rng.choice(pool)
        about = rng.choice(DEPARTMENT_DESCRIPTIONS[dept])
        form = rng.choice(("Is this ticket about %s?", "Does the message concern %s?", "Is it about %s?"))
        out.append(_noul(form % about, dept == t["department"], rng))
    elif extra < 0.65:
        out.append(_noul(rng.choice(("Is this urgent?", "Does this need action today?", "Is the customer blocked?")),
                         t["urgency"] == 2, rng))
    elif extra < 0.75:
        out.append(_noul(rng.choice(("Is the customer unhappy?", "Is the customer upset?")),
                         t["sentiment"] == "negative", rng))
    if not out:
        out.append(_score(rng.choice(_URGENCY_INSTRUCTIONS), rng.choice(_URGENCY_SCALES), t["urgency"]))
    return out


def review_questions(r: dict, rng: random.Random) -> list[tuple[dict, object]]:
    is_plot = r["category"] == "plot"
    out = []
    if is_plot or rng.random() < 0.15:
        plot, opinion = rng.choice(_PLOT_NAMES)
        if rng.random() < 0.6:
            out.append(_choice(rng.choice(("Is this a plot summary or an opinion?", "What kind of text is this?")),
                               [(plot, "describes what happens in the film"), (opinion, "judges the film")],
                               plot if is_plot else opinion, rng))
        else:
            out.append(_noul("Is this text a summary of the story rather than a judgement?", is_plot, rng))
    if not is_plot:
        liked = r["category"] == "fresh"
        form = rng.random()
        if form < 0.5:
            pos, neg = rng.choice(_REVIEW_NAMES)
            out.append(_choice(rng.choice(_REVIEW_INSTRUCTIONS), [(pos, ""), (neg, "")], pos if liked else neg,
                               rng, p_descriptions=0.0))
        elif form < 0.8:
            text, polarity = rng.choice(_REVIEW_NOUL)
            out.append(_noul(text, liked == polarity, rng))
        else:
            out.append(_score(rng.choice(("How positive is this review?", "Rate the critic's verdict.")),
                              rng.choice((("negative", "positive"), ("bad", "good"))), int(liked)))
    return out


def dialog_questions(d: dict, rng: random.Random, pool: tuple[str, ...]) -> list[tuple[dict, object]]:
    out = []
    topic = d["topic"]
    if rng.random() < 0.7:
        others = [s for s in pool if s != topic]
        chosen = rng.sample(others, rng.randint(1, min(7, len(others)))) + [topic]
        out.append(_choice(rng.choice(_TOPIC_INSTRUCTIONS), [dialogs.TOPICS[s] for s in chosen],
                           dialogs.TOPICS[topic][0], rng))
    else:
        stem = topic if rng.random() < 0.5 else rng.choice(pool)
        label, desc = dialogs.TOPICS[stem]
        form = rng.choice((f"Is this conversation about {label}?", f"Does the chat concern {desc}?",
                           f"Is the topic {label}?"))
        out.append(_noul(form, stem == topic, rng))
    return out


def dialog_state(d: dict, rng: random.Random) -> str | list:
    """Dialogs appear as chat-turn lists or as a transcript string, as callers send both."""
    roles = ("user", "assistant")
    if rng.random() < 0.5:
        return [{"role": roles[i % 2], "content": t} for i, t in enumerate(d["turns"])]
    return "\n".join("{}: {}".format(("User", "Bot")[i % 2], t) for i, t in enumerate(d["turns"]))


def example(source: str, state, qs: list[tuple[dict, object]], rng: random.Random, **meta) -> dict:
    """Name the questions (random names: the name never reaches the model, but keeps order honest)."""
    questions, labels = {}, {}
    for i, (q, label) in enumerate(qs):
        name = f"q{i}"
        questions[name] = q
        labels[name] = label
    return {"state": state, "questions": questions, "labels": labels, "source": source, **meta}


def ticket_examples(items: list[dict], seed: int, pool: tuple[str, ...] = tickets.DEPARTMENTS,
                    source: str = "tickets", p_opaque: float = 0.0) -> list[dict]:
    rng = random.Random(seed)
    return [example(source, t["text"], ticket_questions(t, rng, pool, p_opaque), rng) for t in items]


def heldout_department_examples(items: list[dict], seed: int) -> list[dict]:
    """Tickets from departments training never saw, asked about among seen and unseen departments."""
    rng = random.Random(seed)
    pool = tuple(tickets.DEPARTMENTS) + tuple(tickets.HELDOUT_DEPARTMENTS)
    out = []
    for t in items:
        dept = t["department"]
        chosen = rng.sample([d for d in pool if d != dept], rng.randint(1, 4)) + [dept]
        names = {d: rng.choice(DEPARTMENT_NAMES[d]) for d in chosen}
        qs = [_choice(rng.choice(_DEPT_INSTRUCTIONS), [(names[d], rng.choice(DEPARTMENT_DESCRIPTIONS[d]))
                                                       for d in chosen], names[dept], rng)]
        asked = dept if rng.random() < 0.5 else rng.choice(tickets.DEPARTMENTS)
        qs.append(_noul(f"Is this ticket about {rng.choice(DEPARTMENT_DESCRIPTIONS[asked])}?", asked == dept, rng))
        out.append(example("tickets-unseen-labels", t["text"], qs, rng))
    return out


def review_examples(items: list[dict], seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [example("reviews", r["text"], review_questions(r, rng), rng) for r in items]


def dialog_examples(items: list[dict], seed: int, pool: tuple[str, ...], source: str = "dialogs") -> list[dict]:
    rng = random.Random(seed)
    return [example(source, dialog_state(d, rng), dialog_questions(d, rng, pool), rng) for d in items]
