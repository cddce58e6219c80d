"""A local HTTP file server that fails on purpose, for the streaming tests: on a seeded share of the
requests it resets the connection or answers 503; it serves byte ranges and folder listings as object
stores and the hub do. Only on loopback; every request loop is bounded by the client's retries.

    with FlakyServer(folder, reset=0.1, unavailable=0.1) as server:
        url = server.url   # http://127.0.0.1:PORT/
"""

from __future__ import annotations

import random
import re
import socket
import struct
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class FlakyServer:
    """Serves `folder` on 127.0.0.1; `reset` and `unavailable`: the shares of requests that are reset or
    answered 503 (drawn from `seed`, in the order the requests arrive). `stop()` and `start()` take it
    down and up again on the same port."""

    def __init__(self, folder: Path, reset: float = 0.0, unavailable: float = 0.0, seed: int = 0):
        self.folder, self.reset, self.unavailable = folder, reset, unavailable
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts = {"ok": 0, "reset": 0, "503": 0}
        self.port = 0
        self.httpd: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def draw(self) -> str:
        with self.lock:
            x = self.rng.random()
            kind = "reset" if x < self.reset else "503" if x < self.reset + self.unavailable else "ok"
            self.counts[kind] += 1
            return kind

    def start(self) -> FlakyServer:
        server = self

        class Handler(SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(server.folder), **kwargs)

            def log_message(self, *args) -> None:
                pass

            def fail(self) -> bool:
                kind = server.draw()
                if kind == "reset":  # an RST instead of an answer
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                    self.close_connection = True
                    return True
                if kind == "503":
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return True
                return False

            def do_HEAD(self) -> None:
                if not self.fail():
                    super().do_HEAD()

            def do_GET(self) -> None:
                if self.fail():
                    return
                path = Path(self.translate_path(self.path))
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                if not m or not path.is_file():
                    return super().do_GET()
                data = path.read_bytes()
                start = int(m.group(1))
                end = min(int(m.group(2)) if m.group(2) else len(data) - 1, len(data) - 1)
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                self.send_header("Content-Length", str(end - start + 1))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                self.wfile.write(data[start:end + 1])

            def end_headers(self) -> None:
                if self.command == "HEAD" or "Range" not in self.headers:
                    self.send_header("Accept-Ranges", "bytes")
                super().end_headers()

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # a client that hung up mid-answer (a reader stopping early): not the server's failure

        self.httpd = Server(("127.0.0.1", self.port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None

    def __enter__(self) -> FlakyServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
