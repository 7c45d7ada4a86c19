"""Synthetic customer-support tickets with gold department, urgency, churn threat and sentiment.

No public support-ticket corpus installs offline under a clear licence, so we compose tickets from
hand-written fragments. The labels are drawn first and the text is written to them, so every
label is true by construction; the variety (register, length, order of the parts, slots, typos,
one bare line or a letter, no cue at all for some labels) is there so a model must read the ticket
rather than match a template. Department, churn and sentiment are drawn independently. Urgency is
not, because triage does not read it that way: every ticket has the urgency its text implies, which
a cue may override. A problem that stops work ("nobody can log in", or told by its impact alone:
"checkout fails for all of our customers. We can't take any orders.") is blocking, a fault (a wrong
charge, a damaged parcel, a broken feature) is "soon", an inquiry is "not urgent", and a churn
threat makes a ticket at least "soon". Half the tickets whose urgency is the implied one say nothing
about time; any other urgency is always said. (The first version drew urgency independently of the
text, so "refund or we cancel" answered 0.0; the second still made every uncued ticket "not
urgent", so a wrong charge read as calm unless the customer asked for speed.)
`generate` is the public entry point (distillation reuses it for its students).
"""

from __future__ import annotations

import random

DEPARTMENTS = ("billing", "technical", "shipping", "account", "other")
# Departments that training never sees; the held-out test measures answers over unseen options.
HELDOUT_DEPARTMENTS = ("security", "sales")
URGENCY_LEVELS = ("not urgent", "soon", "blocking")
SENTIMENTS = ("negative", "neutral", "positive")

_PRODUCTS = ("Pro plan", "Team plan", "Starter plan", "Business subscription", "premium account",
             "family plan", "annual license", "cloud storage add-on", "analytics package")
_DEVICES = ("iPhone", "Android phone", "Windows laptop", "MacBook", "Chromebook", "iPad", "Linux desktop")
_ITEMS = ("headphones", "desk lamp", "blender", "running shoes", "phone case", "monitor", "coffee grinder",
          "backpack", "keyboard", "winter jacket", "printer", "router")
_CARRIERS = ("UPS", "FedEx", "DHL", "the postal service", "your courier")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December")
_FEATURES = ("the export button", "the dashboard", "two-factor login", "the search page", "file sync",
             "the mobile app", "the API", "notifications", "the checkout page", "the calendar view")
_ERRORS = ("error 500", "a blank white screen", "'something went wrong'", "a timeout", "error code E42",
           "an endless spinner", "'access denied'", "a crash on startup")

# What a ticket is about. A fault (something is wrong and needs fixing) reads as "soon" when the customer says
# nothing about time; an inquiry (a question, a wish, an errand) reads as "not urgent". Triage reads tickets that
# way, and a generator that made every ticket without an urgency cue "not urgent" taught the model that a wrong
# charge or a broken feature is calm unless the customer says otherwise.
_FAULTS: dict[str, tuple[str, ...]] = {
    "billing": (
        "We were billed twice for {month}.",
        "I was charged {amount} but my plan should only cost {amount2}.",
        "My card was charged after I already cancelled the {product}.",
        "The invoice for {month} shows the wrong VAT number.",
        "I need a refund for the duplicate payment on my {product}.",
        "Why did my subscription price go up from {amount2} to {amount} without notice?",
        "The payment failed but the money still left my bank account.",
        "Can you send me a corrected invoice for {month}? The company name is wrong.",
        "I was promised a discount on the {product} and it never showed up on the bill.",
        "There is a charge of {amount} on my statement that I do not recognise.",
        "The refund you confirmed two weeks ago never reached my account.",
        "My coupon code was rejected at checkout although it is still valid.",
        "You charged us for 12 seats but we only have 8 users.",
    ),
    "technical": (
        "The app crashes every time I open {feature} on my {device}.",
        "I keep getting {error} when I try to log in.",
        "{feature} has stopped working since the last update.",
        "Sync between my {device} and the web app is broken, files are missing.",
        "The page loads forever and then shows {error}.",
        "After updating my {device}, the app will not start at all.",
        "Uploads fail halfway through with {error}.",
        "The integration with our CRM stopped pushing data yesterday.",
        "Dark mode looks broken on my {device}, text is unreadable.",
        "Reports export with the wrong dates since the last release.",
        "{feature} shows data from last week instead of today.",
        "The app logs me out every few minutes on my {device}.",
        "Notifications arrive hours late or not at all.",
    ),
    "shipping": (
        "My order {order} still has not arrived after two weeks.",
        "The tracking for order {order} has not updated in five days.",
        "{carrier} says the package was delivered, but there is nothing at my door.",
        "I received the wrong item: I ordered a {item} and got something else.",
        "The {item} arrived damaged, the box was crushed.",
        "Only half of my order arrived; the {item} is missing.",
        "The package with my {item} was returned to sender by {carrier}.",
        "The {item} I got is the wrong size.",
        "You charged me express shipping but the {item} came by regular mail.",
    ),
    "account": (
        "I cannot reset my password, the reset email never arrives.",
        "I got locked out after too many login attempts.",
        "My username is showing the wrong name, can you fix my profile?",
        "I cannot verify my phone number, the code never comes.",
        "The invite I sent to my colleague keeps expiring before she can accept it.",
        "My profile settings reset every time I log in.",
    ),
    "other": (
        "The link to your privacy policy in the newsletter is broken.",
        "Your contact form gives an error when I press send.",
        "The event page lists the wrong date for the Berlin meetup.",
    ),
    "security": (
        "I got an email asking for my password that claims to be from you, is it phishing?",
        "Someone logged into my account from another country last night.",
        "I think my account was hacked, there are purchases I never made.",
        "Do you have a bug bounty? I found a way to see other users' files.",
        "My two-factor codes are being requested although I did not try to log in.",
    ),
    "sales": (
        "The quote you sent for the {product} has the wrong number of seats.",
    ),
}
_INQUIRIES: dict[str, tuple[str, ...]] = {
    "billing": (
        "How do I change the credit card used for my {product}?",
        "I would like a copy of all receipts from this year for our accountant.",
        "Do you offer yearly billing for the {product}?",
        "Can the invoices be addressed to our head office instead?",
        "Which payment methods do you accept?",
        "Could you add our VAT number to future invoices?",
    ),
    "technical": (
        "Is there a way to make {feature} faster? It takes a minute to load.",
        "Does {feature} work on a {device}?",
        "Could you add a dark theme to {feature}?",
        "Is there an API endpoint for exporting reports?",
        "How do I connect the app to our calendar?",
        "Feature idea: let us pin favourites in {feature}.",
    ),
    "shipping": (
        "Can I change the delivery address for order {order}?",
        "When will the {item} be back in stock and shipped?",
        "Do you ship to Canada, and how long does it take?",
        "I need to return the {item}, how do I get a shipping label?",
        "Can you combine my open orders into one parcel?",
        "Do you deliver on Saturdays?",
    ),
    "account": (
        "Please change the email address on my account to my new one.",
        "How do I delete my account and all my data?",
        "I want to add two colleagues to our {product}.",
        "Please merge my two accounts, I signed up twice by mistake.",
        "How can I transfer ownership of the workspace to my coworker?",
        "I would like to downgrade from the {product} to the free tier.",
        "Can I change the language of my account settings?",
    ),
    "other": (
        "I just wanted to say your team did a great job on the new design.",
        "Do you have any job openings for designers?",
        "I'm a journalist writing about your company, who can I talk to?",
        "Would you be interested in a partnership with our podcast?",
        "It would be nice if you offered a student discount someday.",
        "Where is your head office located?",
        "Are you attending the trade fair in Berlin this year?",
        "I have a suggestion: please add a recipe section to the blog.",
        "Is your company carbon neutral?",
        "Can I get a copy of your brand guidelines for a school project?",
    ),
    "security": (
        "Is customer data encrypted at rest? Our auditor needs to know.",
        "Do you publish a security whitepaper?",
    ),
    "sales": (
        "We are a team of 200 and would like a quote for the {product}.",
        "Can we get a demo of the enterprise features before buying?",
        "Do you offer volume pricing for schools?",
        "I'd like to talk to someone about upgrading our whole company.",
        "What does the {product} include compared to the enterprise tier?",
        "Is there a reseller program for agencies?",
    ),
}

_URGENCY_CUES: tuple[tuple[str, ...], ...] = (
    ("No rush on this.", "Whenever you get a chance.", "Just curious, no hurry.", "It's not urgent.",
     "Take your time.", "This can wait until next week.", "Low priority, just letting you know.", "No rush.",
     "Not urgent at all.", "Whenever is convenient.", "No hurry, just wondering.", "Low priority.", "It can wait.",
     "Any time next week is fine.", "Just for my records, no hurry.", "Totally not urgent.", "Just FYI.",
     "Minor thing, no hurry.", "Cosmetic only, fix it whenever.", "Not a big deal, we can live with it.",
     "Nothing you need to do right away.", "Not important, just reporting it."),
    ("Could you look into it this week?", "I'd appreciate a reply soon.", "Please get back to me in the next few days.",
     "It would be good to sort this out soon.", "A quick answer would help.", "Please handle it when you can this week.",
     "Please look at it this week.", "A reply in the next day or two would be great.", "Soon, please.",
     "We'd like this sorted before the end of the week.", "It's getting annoying, please fix it soon.",
     "Would appreciate a quick reply.", "It needs attention but we can work around it for now.",
     "Not critical, but please look into it.", "Not an emergency, but it needs fixing.",
     "We have a workaround for now, but please fix it.", "Not the end of the world, but please sort it out."),
    ("This is urgent!", "Please fix this today.", "We are completely blocked.", "ASAP please, nothing works.",
     "Our business is losing money every hour this continues.", "I need this resolved right now.",
     "Production is down for all our users.", "We have a deadline in two hours and cannot work.",
     "This is blocking us.", "We need this fixed right now.", "Urgent!!", "Nobody can work until this is fixed.",
     "Please treat this as an emergency.", "We are losing customers every minute.", "This needs to happen today.",
     "Please act immediately.", "Right now, please.", "Our deadline is in an hour.", "We're dead in the water."),
)

# Deadlines are often folded into the request itself ("please refund it today") rather than said in a
# sentence of their own; a model that only saw stand-alone cues would miss them.
_URGENCY_DEADLINES: tuple[tuple[str, ...], ...] = (
    (),
    ("this week", "in the next few days", "by Friday", "soon", "before the end of the month", "by Thursday",
     "in the next couple of days", "before next week"),
    ("today", "right away", "immediately", "within the hour", "before tonight", "by end of day", "right now", "now",
     "this morning", "ASAP", "before 5pm today"),
)
_REQUESTS = ("Please sort it out", "Please fix it", "Please refund the difference", "Please correct it",
             "Please look into it", "Can you resolve this", "I need an answer", "I need it resolved",
             "Get back to me", "Please handle it", "Can you look at it")
_DEPARTMENT_REQUESTS = {
    "billing": ("Please refund it", "Refund the duplicate", "Please correct the invoice", "Fix the charge"),
    "technical": ("Fix this", "Can you fix it", "Please get it working again"),
    "account": ("Restore access", "Please fix my account", "Please make the change"),
    "shipping": ("Send it", "Please ship the replacement", "Tell me where it is"),
    "other": ("Please answer", "Let me know"),
}
# Problems that stop work by themselves: blocking unless the customer says otherwise. Customers often tell them by
# their impact alone (who is stopped, what cannot happen) with no word about time, so most are composed from a
# failure and who or what it stops.
_BLOCKING: dict[str, tuple[str, ...]] = {
    "technical": ("The whole site is down for all of our users.", "Nobody on our team can log in.",
                  "Our production system is offline.", "Every request fails with {error}, we can't work.",
                  "The app won't open at all and we have customers waiting.",
                  "Our whole team sees {error} when saving documents.",
                  "{feature} returns {error} for every request since this morning."),
    "account": ("I'm locked out of my account and can't access anything.", "All our admins got locked out.",
                "Our entire team lost access to the workspace."),
    "billing": ("Our account was suspended for non-payment even though we paid, and the service is cut off.",
                "The payment keeps failing and our service shuts off tonight."),
    "shipping": ("The parts for tomorrow's event never arrived and we need them today.",),
}
_IMPACT_FAILURES: dict[str, tuple[str, ...]] = {
    "technical": ("{feature} shows {error} for {who}", "{feature} is down for {who}", "checkout fails for {who}",
                  "the app shows {error} for {who} since {since}", "the screens in {where} went blank after the update",
                  "the label printers print blank pages", "the scanners stopped syncing in {where}",
                  "the booking system stopped working in {where}", "{feature} crashes for {who} since {since}"),
    "account": ("{who} got logged out and cannot sign back in", "single sign-on fails for {who} since {since}",
                "{who} lost access to the workspace"),
    "billing": ("our account was suspended and {who} lost access", "every card payment at checkout is declined"),
    "shipping": ("the delivery with all our stock for the opening is lost", "none of today's orders left the warehouse"),
}
_IMPACT_WHO = ("everyone on our team", "all of our customers", "our whole support team", "all 40 of our agents",
               "every user in the company", "all our stores", "the entire sales floor", "our clients")
_IMPACT_WHERE = ("all 12 stores", "the warehouse", "every branch", "both offices", "the clinic", "our shops")
_IMPACT_SINCE = ("9am", "this morning", "the last update", "an hour ago", "last night's release", "lunch")
_IMPACT_CONSEQUENCES = ("We can't take any orders.", "Customers can't check in.", "Nothing is shipping.",
                        "We can't see any orders.", "The whole shift is sitting idle.", "Sales have stopped.",
                        "Nobody can do their job.", "Our customers are stuck at the counter.",
                        "Patients are waiting in the lobby.", "Every sale is lost.", "")

_CHURN_CUES = (
    "or we will cancel our plan.", "If this is not fixed we are switching to a competitor.",
    "I'm seriously thinking about cancelling my subscription.", "Otherwise I will close my account.",
    "One more problem like this and we are leaving.", "I want to cancel if this cannot be solved.",
    "We are evaluating other providers because of this.", "Please cancel my membership if you can't help.",
    "I will not renew next month unless this is fixed.", "Honestly I'm done with this service.",
    "or we cancel.", "or I cancel.", "or we're cancelling.", "or I'm out.", "or we leave.", "otherwise we cancel.",
    "or we'll cancel the subscription.", "or we switch providers.", "otherwise I'm closing my account.",
    "or I will cancel my membership.",
    "I want to cancel my account.", "Please cancel my subscription, I'm done.", "Close my account.",
    "We're moving to another vendor.", "I'm switching to a competitor.", "We will not renew.",
    "This is the last straw, we're leaving.", "I'll take my business elsewhere.", "Time to look for another service.",
    "If this happens again we cancel.", "We're seriously considering other options.", "I'm about to cancel.",
    "Cancel everything and refund me.", "I regret signing up and want out.", "We are done with your service.",
    "I want to end my contract.", "Our team will drop the product if this continues.",
    "I plan to cancel my plan at the end of the month.", "Terminate my account, please.",
    "Going to unsubscribe if nobody answers.", "I'm leaving for good.",
    "I need to cancel my account.", "We have to cancel our subscription.", "I need to close my account.",
    "We need to cancel the plan.", "Please close our account and stop billing us.", "I want out of the contract.",
    "I'd like to cancel and get my money back.",
)

_SENTIMENT_CUES: tuple[tuple[str, ...], ...] = (
    ("This is really frustrating.", "I'm very disappointed.", "Terrible experience so far.",
     "I am angry about how this was handled.", "This is unacceptable.", "Really annoyed right now."),
    ("", "", "Thanks.", "Regards.", "Let me know."),
    ("I love the product otherwise!", "You have been great so far, thank you.", "Thanks a lot, you're awesome.",
     "Really happy with the service in general.", "Keep up the good work!", "Much appreciated, great team."),
)

_GREETINGS = {
    "formal": ("Dear support team,", "Hello,", "Good morning,", "To whom it may concern,"),
    "casual": ("Hi,", "Hey there,", "Hi team!", "Hello folks,", "yo,"),
    "terse": ("",),
}
_SIGNOFFS = {
    "formal": ("Kind regards, {name}", "Best regards, {name}", "Sincerely, {name}"),
    "casual": ("Cheers, {name}", "thx", "- {name}", "Thanks!"),
    "terse": ("",),
}
_NAMES = ("Anna", "Ben", "Carla", "Dmitri", "Elif", "Farah", "Gustavo", "Hiro", "Ines", "Jamal", "Kofi",
          "Lena", "Marta", "Nikhil", "Olga", "Pedro", "Quinn", "Rosa", "Sven", "Tariq")

# Churn threats a model must not confuse with a real threat: cancelling an order or a meeting, or saying
# cancelling is not the plan.
_CHURN_DECOYS = (
    "I'm not planning to cancel, I just want this fixed.", "We're happy to stay, just need help.",
    "I renewed for another year yesterday.", "I'm not going to cancel, I just need help.",
    "We love the product and plan to stay.", "Please cancel the order, I'll buy a different size.",
    "Can I cancel the meeting we booked with sales?", "We just renewed for two years.",
    "No plans to leave, just reporting it.", "I want to cancel order {order}.", "cancel the duplicate invoice please.",
)


def _typos(text: str, rng: random.Random, rate: float) -> str:
    """Swap, drop or double letters in a few words, the way hurried customers type."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) > 3 and w.isalpha() and rng.random() < rate:
            j = rng.randrange(1, len(w) - 1)
            op = rng.randrange(3)
            if op == 0:
                w = w[:j] + w[j + 1] + w[j] + w[j + 2:]
            elif op == 1:
                w = w[:j] + w[j + 1:]
            else:
                w = w[:j] + w[j] + w[j:]
            words[i] = w
    return " ".join(words)


def _fill(template: str, rng: random.Random) -> str:
    amount = rng.randrange(9, 400)
    return template.format(
        month=rng.choice(_MONTHS), amount=f"${amount}.{rng.randrange(100):02d}",
        amount2=f"${max(5, amount - rng.randrange(3, 60))}.00", product=rng.choice(_PRODUCTS),
        device=rng.choice(_DEVICES), item=rng.choice(_ITEMS), carrier=rng.choice(_CARRIERS),
        order=f"#{rng.randrange(10000, 999999)}", feature=rng.choice(_FEATURES), error=rng.choice(_ERRORS))


def _impact(department: str, rng: random.Random) -> str:
    """A blocking problem told by its impact: what fails, for whom, and what that stops."""
    text = rng.choice(_IMPACT_FAILURES[department]).format(
        who=rng.choice(_IMPACT_WHO), where=rng.choice(_IMPACT_WHERE), since=rng.choice(_IMPACT_SINCE),
        feature=rng.choice(_FEATURES), error=rng.choice(_ERRORS))
    consequence = rng.choice(_IMPACT_CONSEQUENCES)
    return text[0].upper() + text[1:] + "." + (" " + consequence if consequence else "")


def ticket(rng: random.Random, departments: tuple[str, ...] = DEPARTMENTS) -> dict:
    """One ticket: text plus its gold labels, drawn from `rng`."""
    department = rng.choice(departments)
    churn = rng.random() < 0.3
    sentiment = rng.choices((0, 1, 2), weights=(0.5, 0.35, 0.15) if churn else (0.3, 0.45, 0.25))[0]
    register = rng.choice(("formal", "casual", "casual", "terse"))
    blocking = bool(_BLOCKING.get(department)) and rng.random() < 0.15
    if blocking:
        problem = [_impact(department, rng) if rng.random() < 0.6 else _fill(rng.choice(_BLOCKING[department]), rng)]
        urgency = implied = 2
        kind = "blocking"
    else:
        fault = rng.random() < 0.6
        kind = "fault" if fault else "inquiry"
        pool = (_FAULTS if fault else _INQUIRIES)[department]
        problem = [_fill(rng.choice(pool), rng)]
        if rng.random() < 0.3:  # a second sentence about the same problem makes longer tickets
            extra = _fill(rng.choice(pool), rng)
            if extra != problem[0]:
                problem.append(extra)
        urgency = rng.choices((0, 1, 2), weights=(0.45, 0.35, 0.2))[0]
        implied = 1 if fault else 0
        if churn:   # a churn threat makes a ticket at least "soon" even with no word about time
            implied = 1
            if urgency == 0 and rng.random() < 0.9:
                urgency = 1
    parts = list(problem)
    # What the text implies needs no cue half the time; any other urgency is always said, so every label is
    # readable from the text.
    stated: int | None = None if urgency == implied and rng.random() < 0.5 else urgency
    if stated and rng.random() < 0.45:
        request = rng.choice(_REQUESTS + _DEPARTMENT_REQUESTS.get(department, ())) + " " + \
            rng.choice(_URGENCY_DEADLINES[stated])
        parts.append(request + ("?" if request.startswith("Can") else "."))
    elif stated is not None:
        parts.insert(rng.randrange(1, len(parts) + 1), rng.choice(_URGENCY_CUES[stated]))
    if churn:
        cue = rng.choice(_CHURN_CUES)
        if cue.startswith(("or ", "otherwise")):  # "... today or we cancel": glued to the previous sentence
            parts[-1] = parts[-1].rstrip(".!") + rng.choice((", ", " ")) + cue
        else:
            parts.insert(rng.randrange(0, len(parts) + 1), cue)
    elif rng.random() < 0.12:
        parts.append(_fill(rng.choice(_CHURN_DECOYS), rng))
    cue = rng.choice(_SENTIMENT_CUES[sentiment])
    if cue:
        parts.insert(rng.randrange(0, len(parts) + 1), cue)

    greeting = rng.choice(_GREETINGS[register])
    signoff = rng.choice(_SIGNOFFS[register]).format(name=rng.choice(_NAMES))
    if rng.random() < 0.3:   # many real tickets are one bare line
        greeting = signoff = ""
    body = " ".join(parts)
    if register == "terse":
        body = body.replace("Please ", "pls ").replace("please ", "pls ")
    if register != "formal" and rng.random() < 0.3:
        body = body.lower()
    elif rng.random() < 0.05:
        body = body.upper()
    body = _typos(body, rng, rate=rng.choice((0.0, 0.0, 0.03, 0.08)))
    text = rng.choice(("\n", " ")).join(p for p in (greeting, body, signoff) if p)
    return {"text": text, "department": department, "urgency": urgency, "churn": churn,
            "sentiment": SENTIMENTS[sentiment], "register": register, "kind": kind, "urgency_said": stated is not None}


def generate(n: int, seed: int, departments: tuple[str, ...] = DEPARTMENTS) -> list[dict]:
    """`n` tickets, identical for the same (`n`, `seed`, `departments`).

    Each is `{"text", "department", "urgency" (0..2, index into URGENCY_LEVELS), "churn" (bool),
    "sentiment" (one of SENTIMENTS), "register", "kind" ("blocking", "fault" or "inquiry": the urgency the
    problem implies, 2, 1 or 0), "urgency_said" (False: no cue, the urgency is the implied one)}`. Pass `HELDOUT_DEPARTMENTS` (or a mix) to get
    tickets from departments the default training never sees.
    """
    if n < 0:
        raise ValueError(f"tickets.generate: n must be >= 0, got {n!r}")
    unknown = set(departments) - set(_FAULTS)
    if unknown or not departments:
        raise ValueError(f"tickets.generate: departments must be a non-empty subset of {sorted(_FAULTS)}, got {departments!r}")
    rng = random.Random(seed)
    return [ticket(rng, tuple(departments)) for _ in range(n)]
