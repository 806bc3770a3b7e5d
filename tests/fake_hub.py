"""A local stand-in for the Hugging Face hub's HTTP API, enough for ``datasets.load_dataset`` and ``hf_hub_download``.

It serves dataset repositories held in memory (``{repo_id: {path_in_repo: bytes}}``) at one fixed revision,
through the endpoints those libraries call: repository info, tree listing, paths-info, and file resolution
(HEAD and GET with the commit, ETag and size headers). Every request is logged in ``requests`` so a test can
see that the online path really went through HTTP. Other URLs (e.g. a release asset) are served from ``urls``.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse



class FakeHub:
    """A threaded HTTP server on 127.0.0.1 serving ``repos`` (dataset repos) and ``urls`` (plain files)."""

    def __init__(self, repos: dict[str, dict[str, bytes]], urls: dict[str, bytes] | None = None) -> None:
        self.repos = repos
        self.urls = urls or {}
        self.requests: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git blob id, as the hub reports


def _commit(files: dict[str, bytes]) -> str:
    """A commit id that changes with the content (libraries cache by it)."""
    return hashlib.sha1(b"".join(p.encode() + _oid(d).encode() for p, d in sorted(files.items()))).hexdigest()


def _entry(path: str, data: bytes) -> dict:
    return {"type": "file", "path": path, "size": len(data), "oid": _oid(data)}


def _dirs(files: dict[str, bytes]) -> set[str]:
    return {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, value, head: bool = False) -> None:
            self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"}, head)

        def _not_found(self, head: bool = False) -> None:
            body = b'{"error": "Repository not found"}'
            self._send(404, body, {"Content-Type": "application/json", "X-Error-Code": "RepoNotFound"}, head)

        def do_HEAD(self) -> None:
            self._route(head=True)

        def do_GET(self) -> None:
            self._route(head=False)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length).decode()
            self._route(head=False, body=body)

        def _route(self, head: bool, body: str = "") -> None:
            url = urlparse(self.path)
            path = unquote(url.path)
            hub.requests.append(f"{self.command} {self.path}")
            if path in hub.urls:
                return self._send(200, hub.urls[path], {"Content-Type": "application/octet-stream"}, head)
            m = re.fullmatch(r"/datasets/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)", path)
            if m:
                return self._resolve(m["repo"], m["file"], head)
            m = re.fullmatch(r"/api/datasets/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?", path)
            if m:
                return self._info(m["repo"], head)
            m = re.fullmatch(r"/api/datasets/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<sub>.*))?", path)
            if m:
                recursive = parse_qs(url.query).get("recursive", ["false"])[0].lower() == "true"
                return self._tree(m["repo"], (m["sub"] or "").strip("/"), recursive, head)
            m = re.fullmatch(r"/api/datasets/(?P<repo>[^/]+/[^/]+)/paths-info/(?P<rev>[^/]+)", path)
            if m:
                return self._paths_info(m["repo"], body)
            self._not_found(head)

        def _resolve(self, repo: str, file: str, head: bool) -> None:
            files = hub.repos.get(repo)
            if files is None:
                return self._not_found(head)
            if file not in files:
                body = b'{"error": "Entry not found"}'
                headers = {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": _commit(files), "Content-Type": "application/json"}
                return self._send(404, body, headers, head)
            data = files[file]
            headers = {"X-Repo-Commit": _commit(files), "ETag": f'"{_oid(data)}"', "Content-Type": "application/octet-stream"}
            self._send(200, data, headers, head)

        def _info(self, repo: str, head: bool) -> None:
            files = hub.repos.get(repo)
            if files is None:
                return self._not_found(head)
            self._json(
                {
                    "_id": repo,
                    "id": repo,
                    "sha": _commit(files),
                    "private": False,
                    "gated": False,
                    "disabled": False,
                    "downloads": 0,
                    "likes": 0,
                    "tags": [],
                    "lastModified": "2026-01-01T00:00:00.000Z",
                    "siblings": [{"rfilename": p} for p in sorted(files)],
                    "cardData": {},
                },
                head,
            )

        def _tree(self, repo: str, sub: str, recursive: bool, head: bool) -> None:
            files = hub.repos.get(repo)
            if files is None:
                return self._not_found(head)
            prefix = f"{sub}/" if sub else ""
            entries = []
            for d in sorted(_dirs(files)):
                rest = d[len(prefix):]
                if d.startswith(prefix) and rest and (recursive or "/" not in rest):
                    entries.append({"type": "directory", "path": d, "oid": _oid(d.encode()), "size": 0})
            for p in sorted(files):
                rest = p[len(prefix):]
                if p.startswith(prefix) and (recursive or "/" not in rest):
                    entries.append(_entry(p, files[p]))
            if sub and not entries and sub not in files:
                body = b'{"error": "Entry not found"}'
                return self._send(404, body, {"X-Error-Code": "EntryNotFound", "Content-Type": "application/json"}, head)
            self._json(entries, head)

        def _paths_info(self, repo: str, body: str) -> None:
            files = hub.repos.get(repo)
            if files is None:
                return self._not_found()
            try:
                wanted = json.loads(body).get("paths", [])
            except json.JSONDecodeError:
                wanted = parse_qs(body).get("paths", [])
            dirs = _dirs(files)
            out = []
            for p in wanted if isinstance(wanted, list) else [wanted]:
                p = p.strip("/")
                if p in files:
                    out.append(_entry(p, files[p]))
                elif p in dirs or p == "":
                    out.append({"type": "directory", "path": p, "oid": _oid(p.encode()), "size": 0})
            self._json(out)

    return Handler
