"""SIGTERM: stop accepting, finish in-flight requests, exit 0. Stops the main server (the next user restarts it).

Every request is accounted for: a client whose connection was reset (or that timed out) is a lost request
and fails the test, so a server that drops some in-flight work on SIGTERM cannot pass by answering the rest.
"""

from __future__ import annotations

import signal
import threading
import time

import requests
from serving_support import BILLING_STATE, heavy_questions


def test_sigterm_finishes_in_flight_requests(server, agent, billing_questions):
    # long states x 23 questions at max_len 1000 keep the model busy, so SIGTERM lands mid-flight
    states = [f"in flight {i}: " + BILLING_STATE * 30 for i in range(3)]
    questions = {**billing_questions, **heavy_questions(20)}
    results: dict[int, requests.Response] = {}
    lost: dict[int, BaseException] = {}
    finished: dict[int, float] = {}

    def call(i: int) -> None:
        try:
            results[i] = requests.post(server.url + "/decide", timeout=60, json={
                "state": states[i], "questions": questions, "max_len": 1000})
        except BaseException as exc:  # noqa: BLE001 -- a reset or timed-out client is a lost request
            lost[i] = exc
        finished[i] = time.monotonic()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(states))]
    for t in threads:
        t.start()
    time.sleep(0.2)  # let the requests reach the server, then stop it while they run
    server.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a client is still waiting 60 s after SIGTERM"
    assert server.proc.wait(timeout=60) == 0
    assert not lost, f"in-flight requests lost on SIGTERM: {lost}"
    assert sorted(results) == list(range(len(states)))
    for i, r in results.items():
        assert r.status_code == 200, r.text
        assert r.json()["answers"] == agent.predict(states[i], questions, max_len=1000)["answers"]
    assert max(finished.values()) > signalled  # some answers really were delivered after SIGTERM
    try:
        requests.get(server.url + "/health", timeout=5)
        raise AssertionError("the server still accepts connections after SIGTERM")
    except requests.ConnectionError:
        pass
