"""One proxied request as the shell carries it from the handler through the relay.

Rules: a ``Job`` only collects what was decided and what happened (for the relay, the metrics and
the access log); it decides nothing itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.core.errors import UpstreamTimeout
from proxy.core.recording import Recorder
from proxy.core.usage import Usage


@dataclass(slots=True)
class Job:
    """One proxied request on its way through; fields fill in as decisions are made."""

    request_id: str
    started_at: float
    cls: str
    pool: str = "none"
    stream: bool = False
    path: str = ""
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    engine: str = "none"
    status: int = 0
    first_byte_at: float | None = None
    # When the request was first sent to an engine: the proxy's own share of the first-token time
    # ends here (body, admission and any hold, routing).
    dispatched_at: float | None = None
    # Sees the engine's status and every byte relayed (response cache, token accounting).
    recorder: Recorder | None = None
    extra_headers: dict[str, str] = field(default_factory=dict)
    shed_reason: str | None = None
    # Per engine name: prompt blocks it is expected to compute for this request (routing's view).
    prefill: dict[str, float] = field(default_factory=dict)
    # For the access log and accounting: who asked for what, retries made, the engine's usage.
    tenant: str | None = None
    model: str | None = None
    asked_pool: str | None = None
    retries: int = 0
    # The whole stream reached the client: a disconnect after that is not an abort (499).
    delivered: bool = False
    # The client's own limit: seconds it gave, and when that ends on the event loop's clock.
    timeout_s: float | None = None
    deadline: float | None = None
    strip_usage: bool = False  # the engine was asked for usage the client did not ask for
    usage: Usage | None = None
    # Per engine name: prompt tokens it does not hold yet; the client's output cap (KV commitments).
    prompt_tokens: dict[str, float] = field(default_factory=dict)
    max_tokens: int | None = None

    def client_headers(self) -> dict[str, str]:
        ids = {"X-Request-Id": self.request_id, "X-Engine": self.engine, "X-Served-By": self.pool}
        return ids | self.extra_headers


def deadline_error(job: Job) -> UpstreamTimeout:
    return UpstreamTimeout(
        f"the request's deadline of {job.timeout_s:g} s passed before the answer was complete"
    )
