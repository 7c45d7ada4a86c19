"""Auth, a full queue (503 + Retry-After) and a passed deadline (504), on a server with a 2-state queue
and a 1 s deadline; neither loses or mixes up another request's answer. Every request is counted: a client
whose thread raised (a reset connection, a timeout) is a lost request and fails the test."""

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
    r = requests.post(guarded.url + "/decide", headers=AUTH, timeout=30,
                      json={"state": BILLING_STATE, "questions": billing_questions})
    assert r.status_code == 200, r.text
    assert r.json()["answers"] == agent.predict(BILLING_STATE, billing_questions)["answers"]


def test_overload_503_and_deadline_504(guarded, agent, billing_questions):
    heavy: dict = {}
    lost: dict[str, BaseException] = {}

    def occupy() -> None:
        # 2 long states x 256 questions at max_len 1000 (512 rows of ~1,000 tokens, 2 forwards of 256): 64
        # questions took 0.79 s of model time on an idle Zen 5 with AVX-512, under the 1 s deadline, so
        # this asks 4x that: the request passes its deadline and the worker stays busy meanwhile.
        started = time.monotonic()
        try:
            heavy["r"] = requests.post(guarded.url + "/decide/batch", headers=AUTH, timeout=120, json={
                "states": [BILLING_STATE * 40 + " one", BILLING_STATE * 40 + " two"],
                "questions": heavy_questions(256), "max_len": 1000})
        except BaseException as exc:  # noqa: BLE001 -- counted as lost below
            lost["heavy"] = exc
        heavy["s"] = time.monotonic() - started

    blocker = threading.Thread(target=occupy)
    blocker.start()
    time.sleep(0.3)
    results: dict[int, requests.Response] = {}

    def call(i: int) -> None:
        try:
            results[i] = requests.post(guarded.url + "/decide", headers=AUTH, timeout=60,
                                       json={"state": f"ticket {i}", "questions": billing_questions})
        except BaseException as exc:  # noqa: BLE001 -- counted as lost below
            lost[f"ticket {i}"] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads + [blocker]:
        t.join(120)
    assert not any(t.is_alive() for t in threads + [blocker]), "a client still waits after 120 s"
    assert not lost, f"requests without an HTTP answer: {lost}"
    assert sorted(results) == list(range(len(threads))) and "r" in heavy
    r = heavy["r"]
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout", r.text
    assert 0.9 <= heavy["s"] < 10
    statuses = sorted(r.status_code for r in results.values())
    assert 503 in statuses and set(statuses) <= {200, 503, 504}, statuses
    for i, r in results.items():
        if r.status_code == 503:
            assert r.headers["Retry-After"] == "1" and r.json()["error"]["type"] == "overloaded"
        elif r.status_code == 200:  # whoever got through got its own answer
            assert r.json()["answers"] == agent.predict(f"ticket {i}", billing_questions)["answers"]
    # the service recovers once the abandoned work drains, and answers correctly again
    deadline = time.monotonic() + 120
    while True:
        r = requests.post(guarded.url + "/decide", headers=AUTH, timeout=30,
                          json={"state": "later", "questions": billing_questions})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        assert r.status_code in (503, 504), r.text
        time.sleep(0.5)
    assert r.status_code == 200 and r.json()["answers"] == agent.predict("later", billing_questions)["answers"]
