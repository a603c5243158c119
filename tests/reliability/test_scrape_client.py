"""The scraper's own HTTP client (``proxy.fleet.metrics_client``) against a raw server on
127.0.0.1:0 that answers whatever bytes the test gives it: the kept connection, and every way a
reply can go wrong closing it."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator

import pytest

from proxy.fleet.metrics_client import PROXY_SHORT, FetchError, MetricsClient, supports

BODY = b"vllm:num_requests_running 0\n"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)


class RawServer:
    """Answers each request it reads with the next of ``replies`` (the last one repeats);
    ``close_after`` closes a connection after that many replies on it."""

    def __init__(self) -> None:
        self.replies: list[bytes] = [OK]
        self.close_after = 0
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_peer = asyncio.Event()
        self._served = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/metrics"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        on_this = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed_by_peer.set()
                    break
                self.requests.append(head)
                reply = self.replies[min(self._served, len(self.replies) - 1)]
                self._served += 1
                on_this += 1
                if reply:
                    writer.write(reply)
                    await writer.drain()
                if self.close_after and on_this >= self.close_after:
                    break
        except ConnectionError:
            # The client closed while a reply was being written (uvloop reports it on the
            # write, asyncio's own loop on the next read): closed by the peer either way.
            self.closed_by_peer.set()
        writer.close()


@pytest.fixture
async def server() -> AsyncIterator[tuple[RawServer, str]]:
    raw = RawServer()
    url = await raw.start()
    yield raw, url
    await raw.stop()


async def test_one_connection_carries_every_scrape(server: tuple[RawServer, str]) -> None:
    raw, url = server
    client = MetricsClient(max_body=4096)
    for _ in range(5):
        assert await client.get(url) == BODY
    assert raw.connections == 1
    assert raw.requests[0].startswith(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:")
    client.close()


async def test_a_connection_the_server_closed_is_replaced(server: tuple[RawServer, str]) -> None:
    raw, url = server
    raw.close_after = 1  # every kept connection is gone by the next scrape
    client = MetricsClient(max_body=4096)
    for _ in range(3):
        assert await client.get(url) == BODY
    assert raw.connections == 3
    client.close()


async def test_a_connection_closed_before_the_reply_is_a_transport_failure(
    server: tuple[RawServer, str],
) -> None:
    raw, url = server
    raw.replies, raw.close_after = [b""], 1
    with pytest.raises(FetchError) as err:
        await MetricsClient(max_body=4096).get(url)
    assert err.value.reason == "transport" and "127.0.0.1" not in str(err.value)


@pytest.mark.parametrize("status", [301, 302, 404, 500])
async def test_any_status_but_200_fails_by_its_status_and_is_never_followed(
    server: tuple[RawServer, str], status: int
) -> None:
    raw, url = server
    raw.replies = [b"HTTP/1.1 %d X\r\nLocation: http://127.0.0.1:1/m\r\nContent-Length: 99999999"
                   b"\r\n\r\n" % status, OK]
    client = MetricsClient(max_body=4096)
    with pytest.raises(FetchError) as err:
        await client.get(url)
    assert (err.value.reason, err.value.detail) == (f"http_{status}",
                                                    f"metrics answered HTTP {status}")
    assert await client.get(url) == BODY
    assert raw.connections == 2  # the refused reply's connection was not reused
    client.close()


CHUNKS = (b"400\r\n" + b"x" * 1024 + b"\r\n") * 8


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + CHUNKS,
], ids=["declared", "chunked"])
async def test_an_oversized_body_is_refused_and_its_connection_closed(
    server: tuple[RawServer, str], reply: bytes
) -> None:
    raw, url = server
    raw.replies = [reply]
    with pytest.raises(FetchError) as err:
        await MetricsClient(max_body=4096).get(url)
    assert err.value.reason == "too_large"
    await asyncio.wait_for(raw.closed_by_peer.wait(), 5)


async def test_garbage_is_a_transport_failure(server: tuple[RawServer, str]) -> None:
    raw, url = server
    raw.replies = [b"SSH-2.0-OpenSSH\r\n\r\n"]
    with pytest.raises(FetchError) as err:
        await MetricsClient(max_body=4096).get(url)
    assert err.value.reason == "transport"


async def test_a_cancelled_scrape_closes_its_connection(server: tuple[RawServer, str]) -> None:
    raw, url = server
    raw.replies = [b""]  # never answers
    client = MetricsClient(max_body=4096)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(client.get(url), 0.2)
    await asyncio.wait_for(raw.closed_by_peer.wait(), 5)
    assert client.idle_connections == 0


async def test_a_refused_connection_is_a_connect_failure() -> None:
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    with pytest.raises(FetchError) as err:
        await MetricsClient(max_body=4096).get(f"http://127.0.0.1:{port}/metrics")
    assert err.value.reason == "connect" and str(port) not in str(err.value)


async def test_a_proxy_out_of_descriptors_is_its_own_failure_not_the_engines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()

    async def no_descriptor(*args: object, **kwargs: object) -> object:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(loop, "create_connection", no_descriptor)
    with pytest.raises(FetchError) as err:
        await MetricsClient(max_body=4096).get("http://127.0.0.1:9/metrics")
    assert err.value.reason == PROXY_SHORT  # the scraper charges no engine for this reason


def test_only_plain_http_is_spoken_here() -> None:
    assert supports("http://e:8000/metrics")
    assert not supports("https://e:8000/metrics")


async def test_a_kept_connection_closed_unanswered_is_retried_once_on_a_fresh_one(
    server: tuple[RawServer, str],
) -> None:
    raw, url = server
    raw.replies, raw.close_after = [OK, b"", OK], 2  # the 2nd request's connection just closes
    client = MetricsClient(max_body=4096)
    assert await client.get(url) == BODY
    assert await client.get(url) == BODY
    assert raw.connections == 2 and len(raw.requests) == 3
    client.close()


async def test_the_scrapers_future_needs_no_task_on_a_kept_connection(
    server: tuple[RawServer, str],
) -> None:
    raw, url = server
    client = MetricsClient(max_body=4096)
    assert await client.get(url) == BODY
    reply = client.start(url)
    assert not isinstance(reply, asyncio.Task)
    assert await reply == BODY
    reply = client.start(url)
    reply.cancel()  # the scraper's timeout: the connection goes with it
    await asyncio.wait_for(raw.closed_by_peer.wait(), 5)
    assert await client.get(url) == BODY
    assert raw.connections == 2
    client.close()
