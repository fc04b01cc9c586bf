"""What a client may send, and how slowly: the guards in front of the application.

* :class:`RequestGuard`, an ASGI middleware: a ``Host`` header this server does not answer to
  is refused (400) when no API key protects it, against DNS rebinding (a web page whose own
  name resolves to 127.0.0.1 would otherwise reach a server on the user's machine through the
  user's browser); a body larger than the limit is refused (413) before it is read whole; a
  body that does not arrive in time is refused (408). The body is read here, whole, before the
  application sees the request.
* :class:`HeaderTimeoutProtocol`, uvicorn's HTTP/1.1 protocol with a deadline on each request's
  head (its request line and headers): a client that connects and sends them slowly, or not at
  all, is answered 408 and disconnected rather than holding a connection forever.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from levanter_serve.defaults import DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_BODY_BYTES  # noqa: F401 (re-exported)
from levanter_serve.errors import ApiError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
"""The host names a server without an API key answers to by default, beside any IP address."""


class HostAllowList:
    """The ``Host`` header values a server answers to: the names given (``*``: any), any IP
    address (an address cannot be rebound to another machine by DNS), and a request with no
    ``Host`` header at all (no browser sends one)."""

    def __init__(self, names: list[str] | tuple[str, ...]):
        self.any = "*" in names
        self.names = {n.lower().strip("[]") for n in names}

    def allows(self, host: str | None) -> bool:
        if self.any or host is None:
            return True
        name = _host_name(host)
        if name in self.names:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


def _host_name(host: str) -> str:
    """A ``Host`` header's name without its port (``[::1]:8000`` -> ``::1``), lowercase."""
    host = host.strip().lower()
    if host.startswith("["):  # an IPv6 address, with or without a port
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return host.rstrip(".")


class RequestGuard:
    """ASGI middleware around ``app`` (see the module docstring). ``allowed_hosts`` None: every
    ``Host`` is answered (the server has an API key). ``max_body_bytes``: the largest body;
    ``body_timeout``: seconds the whole body may take to arrive."""

    def __init__(self, app, *, allowed_hosts: HostAllowList | None, max_body_bytes: int, body_timeout: float):
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host")
        if self.allowed_hosts is not None and not self.allowed_hosts.allows(host):
            message = (
                f"this server does not answer to the host name {host!r} (a guard against DNS rebinding): "
                "use 127.0.0.1 or localhost, or start it with --allowed-host NAME (or --api-key)"
            )
            return await self._refuse(ApiError(400, message, code="invalid_host"), scope, receive, send)
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await self._refuse(self._too_large(length), scope, receive, send)
        try:
            body = await self._read_body(receive)
        except ApiError as e:
            return await self._refuse(e, scope, receive, send)
        if body is None:  # the client went away while sending it
            return None
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # from now on only http.disconnect comes

        return await self.app(scope, replay, send)

    async def _read_body(self, receive) -> bytes | None:
        """The whole body, within ``max_body_bytes`` (else 413) and ``body_timeout`` (else 408)."""
        parts, size = [], 0
        deadline = time.monotonic() + self.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise ApiError(
                    408,
                    f"the request body did not arrive within {self.body_timeout:g} seconds (--body-timeout)",
                    code="request_timeout",
                ) from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large(None)
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    def _too_large(self, length: str | None) -> ApiError:
        given = f" ({length} bytes)" if length is not None and length.isdigit() else ""
        message = (
            f"the request body{given} is larger than this server takes, {self.max_body_bytes:,} bytes (--max-body-size)"
        )
        return ApiError(413, message, code="request_too_large")

    @staticmethod
    async def _refuse(error: ApiError, scope, receive, send) -> None:
        """Answer ``error`` and close the connection (the rest of the body is not read)."""
        response = error.response()
        response.headers["connection"] = "close"
        await response(scope, receive, send)


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline on each request's head: from the moment a
    connection opens (or its previous answer ends) the client has ``header_timeout`` seconds
    (:attr:`header_timeout`, set by :func:`protocol_with_header_timeout`) to send a whole
    request line and its headers. A client that does not is answered 408 and disconnected (one
    that has sent nothing at all, e.g. an idle keep-alive connection, is disconnected quietly)."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._head_begun = False  # part of a request's head has arrived
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._head_begun = bool(data)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._head_begun = False
        self._arm_head_deadline()

    def connection_lost(self, exc) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def _waiting_for_head(self) -> bool:
        return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

    def _arm_head_deadline(self) -> None:
        """Start the clock when a head is awaited (and it is not running), stop it once one is in."""
        if not self._waiting_for_head():
            self._disarm_head_deadline()
        elif self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.header_timeout, self._head_too_slow)

    def _disarm_head_deadline(self) -> None:
        if getattr(self, "_head_deadline", None) is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if not self._waiting_for_head():
            return
        if not self._head_begun:
            self.transport.close()
            return
        body = json.dumps(
            ApiError(
                408,
                f"the request's headers did not arrive within {self.header_timeout:g} seconds (--header-timeout)",
                code="request_timeout",
            ).body()
        ).encode()
        head = (
            "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()


def protocol_with_header_timeout(seconds: float) -> type[HeaderTimeoutProtocol]:
    """:class:`HeaderTimeoutProtocol` with a deadline of ``seconds`` (uvicorn's ``http`` setting)."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": seconds})
