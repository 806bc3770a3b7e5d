"""Test helpers for `harness serve`: a tiny model folder, run an app on a loopback port (behind a probe that counts
requests and injects failures), send JSON and streamed requests, read /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import uvicorn

from opd_harness.models.tiny import TinyArch, build_char_tokenizer, build_tiny_model, save_model_and_tokenizer


def saved_tiny_model(folder: Path, *, seed: int) -> Path:
    """A tiny character-level model saved to ``folder/tiny`` (what `harness serve --model` loads)."""
    tok = build_char_tokenizer()
    arch = TinyArch(hidden=32, layers=1, heads=2, kv_heads=1, ffn=64, max_positions=128)
    model = build_tiny_model(arch, len(tok), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, seed=seed)
    save_model_and_tokenizer(model, tok, folder / "tiny")
    return folder / "tiny"


class Probe:
    """ASGI wrapper: counts POSTs and concurrent in-flight POSTs; can fail or refuse the next ones."""

    def __init__(self, app) -> None:
        self.app = app
        self.reset()

    def reset(self) -> None:
        self.posts = 0
        self.inflight = 0
        self.max_inflight = 0
        self.fail_next: list[int] = []
        self.delay_s = 0.0
        self.refuse_token_prompts = False
        self.bodies: list[dict] = []

    async def _reply(self, send, status: int, message: str) -> None:
        body = json.dumps({"error": {"message": message, "type": "test", "param": None, "code": None}}).encode()
        headers = [(b"content-type", b"application/json"), (b"retry-after-ms", b"10")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        self.posts += 1
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        with contextlib.suppress(ValueError):
            self.bodies.append(json.loads(raw))
        if self.fail_next:
            return await self._reply(send, self.fail_next.pop(0), "injected failure")
        if self.refuse_token_prompts and self.bodies and isinstance(self.bodies[-1].get("prompt"), list):
            return await self._reply(send, 400, "token-id prompts are not accepted here")

        async def replay():
            return {"type": "http.request", "body": raw, "more_body": False}

        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            await self.app(scope, replay, send)
        finally:
            self.inflight -= 1


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


def post(url: str, path: str, body: dict, *, timeout: float = 60) -> tuple[int, dict]:
    status, answer, _ = post_raw(url, path, json.dumps(body).encode(), timeout=timeout)
    return status, answer


def post_raw(url: str, path: str, data: bytes, *, timeout: float = 60) -> tuple[int, dict, dict[str, str]]:
    """POST ``data`` as it is: the status, the parsed JSON answer and the response headers (lower-case names)."""
    request = urllib.request.Request(url + path, data=data, method="POST", headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read()), {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), {k.lower(): v for k, v in exc.headers.items()}


def post_stream(url: str, path: str, body: dict) -> list[dict | str]:
    """The server-sent events of a streamed request: parsed JSON chunks, and the final ``"[DONE]"``."""
    request = urllib.request.Request(
        url + path, data=json.dumps({**body, "stream": True}).encode(), method="POST", headers={"content-type": "application/json"}
    )
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
