"""Plain HTTP/1.1 on the host: probes, liveness checks, metrics, webhook notices. Never raises."""

from __future__ import annotations

from .common import Json, describe


def request(
    host: str,
    port: int,
    path: str,
    *,
    timeout: float,
    limit: int = 0,
    headers: dict[str, str] | None = None,
    method: str = "GET",
    body: bytes | None = None,
) -> Json:
    """{status, error, body (bytes, at most ``limit`` + 1, None unless a status came back)}."""
    import http.client
    import socket

    out: Json = {"status": None, "error": None, "body": None}
    conn = http.client.HTTPConnection(host, port, timeout=max(0.05, timeout))
    try:
        hdrs = {"Connection": "close", "Accept": "application/json"}
        hdrs.update(headers or {})
        if body is not None:
            hdrs.setdefault("Content-Type", "application/json")
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        out["status"] = resp.status
        out["body"] = resp.read(limit + 1)
    except ConnectionRefusedError:
        out["error"] = "connection refused"
    except (socket.timeout, TimeoutError):
        out["error"] = "timed out"
    except http.client.RemoteDisconnected:
        out["error"] = "connection closed without a response"
    except socket.gaierror as exc:
        out["error"] = f"cannot resolve {host}: {exc}"
    except ConnectionResetError:
        out["error"] = "connection reset"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        out["error"] = describe(exc)
    finally:
        conn.close()
    return out


def post_json(url: str, body: Json, timeout: float) -> Json:
    """POST ``body`` as JSON to ``url`` (http or https): {status, error}. Never raises."""
    import json
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return {"status": resp.status, "error": None}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "error": f"HTTP {exc.code}"}
    except urllib.error.URLError as exc:
        return {
            "status": None,
            "error": describe(exc.reason)
            if isinstance(exc.reason, BaseException)
            else str(exc.reason),
        }
    except (OSError, ValueError) as exc:
        return {"status": None, "error": describe(exc)}
