"""A stub OpenAI-compatible judge for fast tests (stdlib HTTP server on 127.0.0.1, no model).

``POST <base>/ok/v1/chat/completions`` answers the verdict ``yes``; ``<base>/status-<N>/v1/...`` answers HTTP ``N``
with an OpenAI-style error body. Every request's path and ``Authorization`` header are kept in ``requests``.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubJudge:
    """Use as a context manager; :meth:`url` gives a route's base URL (ending in ``/v1``)."""

    def __init__(self):
        self.requests: list[dict] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                stub.requests.append({"path": self.path, "authorization": self.headers.get("Authorization"),
                                      "body": json.loads(body or b"{}")})
                route = self.path.strip("/").split("/")[0]
                if route.startswith("status-"):
                    status = int(route.removeprefix("status-"))
                    return self._send(status, {"error": {"message": f"stub refusal {status}", "type": "stub"}})
                return self._send(200, {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                                        "choices": [{"index": 0, "finish_reason": "stop",
                                                     "message": {"role": "assistant", "content": "yes"}}]})

            def _send(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def url(self, route: str = "ok") -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/{route}/v1"

    def __enter__(self) -> "StubJudge":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
