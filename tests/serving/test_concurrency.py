"""32 concurrent clients x 20 requests with mixed questions against one server: zero errors, own answers."""

from __future__ import annotations

import threading

import requests
from serving_support import BILLING_STATE

CLIENTS, REQUESTS = 32, 20


def test_concurrent_clients_get_their_own_answers(server, agent, billing_questions):
    names = list(billing_questions)
    # Client c asks its own state and its own subset of questions, so a mixed-up answer cannot pass.
    work = []
    for c in range(CLIENTS):
        subset = {n: billing_questions[n] for i, n in enumerate(names) if (c >> i) & 1 or i == c % 3}
        work.append((f"client {c}: {BILLING_STATE[: 20 + 3 * c]}", subset))
    expected = [agent.predict(state, questions) for state, questions in work]
    failures: list[str] = []
    done = [0] * CLIENTS

    def client(c: int) -> None:
        state, questions = work[c]
        with requests.Session() as session:
            for i in range(REQUESTS):
                path = "/decide" if i % 4 else "/v1/systemone"
                try:
                    r = session.post(server.url + path, json={"state": state, "questions": questions}, timeout=120)
                except requests.RequestException as exc:
                    failures.append(f"client {c} request {i}: {exc}")
                    return
                if r.status_code != 200:
                    failures.append(f"client {c} request {i}: {r.status_code} {r.text[:200]}")
                    continue
                answers = {n: {k: v for k, v in a.items() if k != "x_jev_confidence"}
                           for n, a in r.json()["answers"].items()}
                if answers != expected[c]["answers"]:
                    failures.append(f"client {c} request {i}: answers differ from its own predict")
                done[c] += 1

    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not failures, failures[:5]
    assert done == [REQUESTS] * CLIENTS
    stats = requests.get(server.url + "/stats", timeout=10).json()
    # cross-request batching happened: some forward pass carried more rows than any one request has
    assert max(int(k) for k in stats["batch_size_histogram"]) > len(billing_questions), stats
