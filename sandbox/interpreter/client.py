"""The exec transport's client (see ``opd_harness.sandbox.interpreter``): ``python -I -S -c <this file> KEY REQUEST_CHUNK...``.

Hands the request (the concatenation of the chunks) to the supervisor listening on the abstract socket ``"\\0KEY"`` and
prints its reply; prints ``NOSERVER`` and exits 3 when nobody listens there.
"""

import socket
import sys


def main():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect("\0" + sys.argv[1])
    except OSError:
        sys.stdout.write("NOSERVER")
        sys.exit(3)
    data = "".join(sys.argv[2:]).encode()
    s.sendall(len(data).to_bytes(4, "big") + data)
    out = []
    while True:
        chunk = s.recv(1 << 16)
        if not chunk:
            break
        out.append(chunk)
    sys.stdout.buffer.write(b"".join(out))


if __name__ == "__main__":
    main()
