"""What stands between this process and an HTTP judge, named in the judge's transport errors: a TLS certificate the
client does not trust, and a proxy that the environment routes the judge's URL through
(docs/grading.md#judge-over-https-and-proxies).

The openai client (httpx) reads the system's CA bundle, ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``, and the proxy
variables ``http_proxy`` / ``https_proxy`` / ``all_proxy`` with ``no_proxy``, loopback addresses included; its
errors say "Connection error." or show the proxy's HTTP status as the judge's.
"""

from __future__ import annotations

import os
import ssl
import urllib.parse
import urllib.request
from typing import Optional

__all__ = ["judge_proxy", "transport_hint"]


def judge_proxy(base_url: str, environ: Optional[dict] = None) -> Optional[tuple[str, str]]:
    """The proxy the environment routes ``base_url`` through: ``(variable, proxy URL)``, or None when no proxy
    variable applies (none set, or ``no_proxy`` covers the host).

    Args:
        base_url: the judge's base URL (``http://host:port/v1``).
        environ: the environment (default: this process's).
    """
    parts = urllib.parse.urlsplit(base_url)
    scheme, host = parts.scheme.lower(), parts.hostname or ""
    env = dict(os.environ if environ is None else environ)
    found = {}
    for name in (f"{scheme}_proxy", "all_proxy"):  # lower case first, as httpx and urllib read them
        for spelled in (name, name.upper()):
            if env.get(spelled):
                found.setdefault(name, (spelled, env[spelled]))
    if not found:
        return None
    bypass = env.get("no_proxy", env.get("NO_PROXY", ""))
    if bypass and urllib.request.proxy_bypass_environment(host, {"no": bypass}):
        return None
    return found.get(f"{scheme}_proxy") or found["all_proxy"]


def _tls_failure(exc: BaseException) -> Optional[BaseException]:
    """The TLS verification error in ``exc``'s chain of causes, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ssl.SSLError) or "CERTIFICATE_VERIFY_FAILED" in str(exc):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def transport_hint(exc: BaseException, base_url: str, environ: Optional[dict] = None) -> str:
    """What the judge's transport error most likely comes from, with the fix, or ``""``: a certificate the client
    does not trust (name ``SSL_CERT_FILE``), or a proxy variable that applies to the judge's URL (name
    ``no_proxy``). Read where the error is reported, so the message says it before the generic hint.

    Args:
        exc: the openai client's exception (its ``__cause__`` chain holds httpx's and ssl's).
        base_url: the judge's base URL.
        environ: the environment (default: this process's).
    """
    tls = _tls_failure(exc)
    if tls is not None:
        return (f"; the TLS handshake failed ({str(tls)[:160]}): the judge's certificate is not signed by a CA this "
                "machine trusts; export SSL_CERT_FILE=<your CA bundle .pem> (and SSL_CERT_DIR for a directory) in "
                "the shell that starts setgrpo-verl, so main_ppo and the reward workers inherit it, or serve the "
                "judge with a certificate of a public CA")
    proxy = judge_proxy(base_url, environ)
    if proxy is not None:
        host = urllib.parse.urlsplit(base_url).hostname
        return (f"; the request went through the proxy {proxy[0]}={proxy[1]}, not straight to the judge (an error "
                f"status may be the proxy's): if the judge is reachable without it, export no_proxy={host} (add it to "
                "NO_PROXY too) in the shell that starts setgrpo-verl")
    return ""
