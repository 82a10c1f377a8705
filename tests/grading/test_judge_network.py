"""A judge behind a certificate this machine does not trust, and a judge URL the environment routes through a proxy:
the judge's error names the cause and the fix (SSL_CERT_FILE; no_proxy) instead of "cannot be reached" or "check
the model name" (docs/grading.md#judge-over-https-and-proxies). Real TLS handshake and a real proxy on loopback."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from setgrpo_verl.grading.network import judge_proxy
from setgrpo_verl.rundir import LaunchError
from setgrpo_verl.runner.preflight import probe_judge


class _Answer502(BaseHTTPRequestHandler):
    seen: list = []

    def log_message(self, *args):
        pass

    def _deny(self):
        _Answer502.seen.append(self.requestline)
        body = b"<html>ERR_CONNECT_FAIL</html>"
        self.send_response(502)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_CONNECT = _deny


@pytest.fixture
def server():
    started = []

    def start(handler, context=None):
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        if context is not None:
            httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append(httpd)
        return httpd.server_address[1]

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


def _probe(base_url: str) -> str:
    grader = {"type": "openai", "base_url": base_url, "model": "judge", "max_retries": 0, "timeout": 5}
    with pytest.raises(LaunchError) as info:
        probe_judge(grader)
    return str(info.value)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command for a throw-away certificate")
def test_a_self_signed_judge_names_ssl_cert_file(server, tmp_path, monkeypatch):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp_path / "k.pem"),
                    "-out", str(tmp_path / "c.pem"), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "c.pem", tmp_path / "k.pem")
    port = server(_Answer502, context)
    for name in ("SSL_CERT_FILE", "SSL_CERT_DIR", "http_proxy", "https_proxy", "all_proxy", "HTTPS_PROXY",
                 "HTTP_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    text = _probe(f"https://127.0.0.1:{port}/v1")
    assert "the TLS handshake failed" in text and "CERTIFICATE_VERIFY_FAILED" in text, text
    assert "export SSL_CERT_FILE=<your CA bundle .pem>" in text


def test_a_judge_behind_a_proxy_names_no_proxy(server, monkeypatch):
    proxy = server(_Answer502)
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{proxy}")
    for name in ("no_proxy", "NO_PROXY", "HTTP_PROXY"):
        monkeypatch.delenv(name, raising=False)
    _Answer502.seen.clear()
    text = _probe("http://127.0.0.1:9/v1")  # nothing listens there: only the proxy answers
    assert _Answer502.seen, "the request did not go through the proxy"
    assert "answered HTTP 502" in text
    assert f"the request went through the proxy http_proxy=http://127.0.0.1:{proxy}" in text, text
    assert "export no_proxy=127.0.0.1" in text


def test_no_proxy_and_the_scheme_decide_whether_a_proxy_applies():
    env = {"http_proxy": "http://proxy:3128", "no_proxy": "judge.internal,127.0.0.1"}
    assert judge_proxy("http://127.0.0.1:8000/v1", env) is None
    assert judge_proxy("http://judge.internal:8000/v1", env) is None
    assert judge_proxy("http://other:8000/v1", env) == ("http_proxy", "http://proxy:3128")
    assert judge_proxy("https://other:8000/v1", env) is None  # http_proxy is for http:// URLs only
    assert judge_proxy("https://other/v1", {"ALL_PROXY": "socks5://p:1080"}) == ("ALL_PROXY", "socks5://p:1080")
