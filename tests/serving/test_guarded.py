"""Auth, a full queue (503 + Retry-After) and a passed deadline (504), on a server configured to show them."""

from __future__ import annotations

import threading
import time

import requests
from serving_support import API_KEY, BILLING_STATE, heavy_questions

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_auth(guarded, agent, billing_questions):
    assert requests.get(guarded.url + "/health", timeout=10).status_code == 200  # always open
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": "Bearer s\u00e9cret"}):
        for method, path in (("get", "/ready"), ("get", "/metrics"), ("post", "/decide")):
            r = requests.request(method, guarded.url + path, headers=headers, json={}, timeout=10)
            assert r.status_code == 401, (headers, path, r.text)
            assert r.json()["error"]["type"] == "unauthorized" and r.headers["WWW-Authenticate"] == "Bearer"
    # three question rows fill this server's batch, so the decision runs at once
    r = requests.post(guarded.url + "/decide", headers=AUTH, timeout=30,
                      json={"state": BILLING_STATE, "questions": billing_questions})
    assert r.status_code == 200, r.text
    assert r.json()["answers"] == agent.predict(BILLING_STATE, billing_questions)["answers"]


def test_deadline_is_504_and_nothing_is_lost(guarded, agent, billing_questions):
    one = {"urgency": billing_questions["urgency"]}
    started = time.monotonic()
    # one row waits for company (3 s) past the 1 s deadline
    r = requests.post(guarded.url + "/decide", headers=AUTH, json={"state": BILLING_STATE, "questions": one},
                      timeout=30)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["type"] == "timeout" and 0.9 <= time.monotonic() - started < 3.0
    r = requests.post(guarded.url + "/decide", headers=AUTH, json={"state": "after", "questions": billing_questions},
                      timeout=30)
    assert r.status_code == 200 and r.json()["answers"] == agent.predict("after", billing_questions)["answers"]


def test_full_queue_is_503_with_retry_after(guarded, agent, billing_questions):
    slow: dict = {}

    def occupy() -> None:  # two long states x 40 questions: the model worker is busy for a while
        slow["r"] = requests.post(guarded.url + "/decide/batch", headers=AUTH, timeout=60, json={
            "states": [BILLING_STATE * 40 + " one", BILLING_STATE * 40 + " two"],
            "questions": heavy_questions(), "max_len": 1000})

    blocker = threading.Thread(target=occupy)
    blocker.start()
    time.sleep(0.2)
    results: dict[int, requests.Response] = {}

    def call(i: int) -> None:
        results[i] = requests.post(guarded.url + "/decide", headers=AUTH, timeout=60,
                                   json={"state": f"ticket {i}", "questions": billing_questions})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads + [blocker]:
        t.join(60)
    statuses = sorted(r.status_code for r in results.values())
    assert 503 in statuses, statuses
    assert set(statuses) <= {200, 503, 504}, statuses
    for i, r in results.items():
        if r.status_code == 503:
            assert r.headers["Retry-After"] == "1" and r.json()["error"]["type"] == "overloaded"
        elif r.status_code == 200:  # whoever got through got its own answer
            assert r.json()["answers"] == agent.predict(f"ticket {i}", billing_questions)["answers"]
    assert slow["r"].status_code in (200, 504)
    # the service recovers: once the abandoned work drains, requests are answered again, correctly
    for _ in range(20):
        r = requests.post(guarded.url + "/decide", headers=AUTH, timeout=30,
                          json={"state": "later", "questions": billing_questions})
        if r.status_code == 200:
            break
        assert r.status_code in (503, 504), r.text
        time.sleep(0.5)
    assert r.status_code == 200 and r.json()["answers"] == agent.predict("later", billing_questions)["answers"]
