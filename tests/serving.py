"""Test helpers for `harness serve`: run an app on a loopback port, send JSON and streamed requests, read /metrics."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import uvicorn


@contextlib.contextmanager
def running(app):
    """Serve ``app`` on a free loopback port in a background thread; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST", headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def post_stream(url: str, path: str, body: dict) -> list[dict | str]:
    """The server-sent events of a streamed request: parsed JSON chunks, and the final ``"[DONE]"``."""
    request = urllib.request.Request(url + path, data=json.dumps({**body, "stream": True}).encode(), method="POST", headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [block for block in raw.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in events), raw
    return [block[6:] if block == "data: [DONE]" else json.loads(block[6:]) for block in events]


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {name: float(value) for name, value in (line.split() for line in lines if not line.startswith("#"))}
