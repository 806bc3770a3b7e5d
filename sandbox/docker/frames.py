"""The wire formats: requests to a pooled container's exec server, and the demultiplexing of Docker's attach and exec
streams into (stream, data) frames (through http.client's buffered reader, see :func:`_demux`)."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterator

from opd_harness.sandbox import OutputBuffer
from opd_harness.sandbox.docker.box import Infra


def server_request(header: dict, tar: bytes) -> bytes:
    """One request on the exec server's stdin (see ``exec_server.py``)."""
    head = json.dumps(header).encode()
    return struct.pack(">I", len(head)) + head + struct.pack(">Q", len(tar)) + tar


class ServerStream:
    """The stdin and stdout of a pooled container's exec server (its PID 1, ``exec_server.py``), attached once."""

    def __init__(self, api, container_id: str) -> None:
        self._res = api._post(api._url("/containers/{0}/attach", container_id), headers={"Connection": "Upgrade", "Upgrade": "tcp"},
                              params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}, stream=True)
        try:
            api._raise_for_status(self._res)
            sock = api._get_raw_response_socket(self._res)
            api._disable_socket_timeout(sock)
            self._sock = getattr(sock, "_sock", sock)
        except BaseException:
            self.close()
            raise
        self._frames = _demux(self._res)
        self._buf = bytearray()
        self.stderr = OutputBuffer(4096)  # what the server itself wrote there (a traceback if it crashed)

    def send(self, data: bytes) -> None:
        self._sock.sendall(data)

    def frame(self) -> tuple[bytes, bytes] | None:
        """The server's next reply frame (kind, data), or None when its stream ended."""
        while True:
            if len(self._buf) >= 5:
                size = struct.unpack(">I", self._buf[1:5])[0]
                if len(self._buf) >= 5 + size:
                    kind, data = bytes(self._buf[:1]), bytes(self._buf[5 : 5 + size])
                    del self._buf[: 5 + size]
                    return kind, data
            stream, data = next(self._frames, (0, b""))
            if stream == 0:
                return None
            if stream == 1:
                self._buf += data
            else:
                self.stderr.add(data)

    def close(self) -> None:
        """Shut the connection down (a run blocked reading it wakes up) and close it."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._res.close()
        except Exception:  # noqa: BLE001
            pass


def exec_frames(api, exec_id: str) -> Iterator[tuple[int, bytes]]:
    """Start an exec and yield its (stream, data) frames (1 stdout, 2 stderr) until it ends (see :func:`_demux`)."""
    res = api._post_json(api._url("/exec/{0}/start", exec_id), headers={"Connection": "Upgrade", "Upgrade": "tcp"},
                         data={"Tty": False, "Detach": False}, stream=True)
    try:
        api._raise_for_status(res)
        api._disable_socket_timeout(api._get_raw_response_socket(res))
        yield from _demux(res)
    finally:
        res.close()


def _demux(res) -> Iterator[tuple[int, bytes]]:
    """The (stream, data) frames (1 stdout, 2 stderr) of an upgraded exec or attach response, until it ends.

    docker-py's own demultiplexer (``exec_start(stream=True, demux=True)``) reads the raw socket underneath
    http.client's buffered reader, so output that arrived together with the response headers is skipped and the
    frames lose their alignment ("ValueError: 56 is not a valid stream", docker-py #3160; seen here under load when
    a program writes at once). This reads the frames through that buffered reader instead (docker 7.2 internals).

    Raises:
        Infra: the stream is not a valid multiplexed stream.
    """
    reader = res.raw._fp.fp  # the buffered reader http.client parsed the headers with
    while True:
        header = reader.read(8)
        if len(header) < 8:
            return
        stream, size = struct.unpack(">BxxxL", header)
        if stream not in (1, 2):
            raise Infra(f"docker stream out of frame alignment (stream id {stream})")
        data = reader.read(size)
        if data:
            yield stream, data
        if len(data) < size:
            return
