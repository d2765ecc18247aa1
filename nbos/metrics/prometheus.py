"""The gateway's Prometheus endpoint: event counters, cluster gauges, a small HTTP server.

:class:`PrometheusEvents` is the :class:`~nbos.metrics.Events` sink that counts
into a private registry; :class:`ClusterCollector` reads the gauges (GPUs by state
per host, kernels by state, live replicas) from the gateway when scraped, so they are never
stale. :func:`serve_metrics` answers ``GET /metrics`` on the event loop itself:
every read of the gateway's state happens on the loop that changes it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping

import anyio
import anyio.abc
import attrs
from anyio.streams.buffered import BufferedByteReceiveStream
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nbos.core.errors import ConfigError, TransportError
from nbos.metrics import ClusterEvent

log = logging.getLogger(__name__)

# Cells wait from milliseconds (GPUs free) to hours (a busy cluster); they run as long.
_CELL_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600)
_MAX_REQUEST = 8192
_REQUEST_TIMEOUT_S = 10.0


class PrometheusEvents:
    """Counts events into ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._waited = Histogram(
            "nbos_cell_wait_seconds",
            "From a cell's request until its executor and GPUs were granted.",
            buckets=_CELL_BUCKETS,
            registry=registry,
        )
        self._ran = Histogram(
            "nbos_cell_run_seconds",
            "How long a cell held its executor and GPUs.",
            buckets=_CELL_BUCKETS,
            registry=registry,
        )
        self._moved = Counter(
            "nbos_replicas_moved",
            "Replicas started in place of another: replacement (died), migration (GPUs).",
            ["kind"],
            registry=registry,
        )
        for kind in ("replacement", "migration"):
            self._moved.labels(kind)  # shown as 0 before the first one
        self._delayed = Counter(
            "nbos_cell_delay_seconds",
            "Seconds started cells waited from their request to their start, by cause: "
            "queue (behind earlier cells of the kernel), gpus, migration, scale_out, overhead.",
            ["cause"],
            registry=registry,
        )
        for cause in ("queue", "gpus", "migration", "scale_out", "overhead"):
            self._delayed.labels(cause)  # shown as 0 before the first cell
        self._refused = Counter(
            "nbos_messages_refused",
            "Client messages refused: unsigned, wrongly signed or malformed.",
            registry=registry,
        )

    def cell_waited(self, seconds: float) -> None:
        self._waited.observe(seconds)

    def cell_ran(self, seconds: float) -> None:
        self._ran.observe(seconds)

    def cell_delayed(self, cause: str, seconds: float) -> None:
        self._delayed.labels(cause).inc(max(0.0, seconds))

    def happened(self, event: ClusterEvent) -> None:
        if event.kind in ("replacement", "migration"):
            self._moved.labels(event.kind).inc()

    def message_refused(self) -> None:
        self._refused.inc()


@attrs.frozen
class UserSample:
    """One user's figures: live kernels, cells waiting for GPUs, GPUs held by their cells
    now (pre-committed or committed), and GPU-seconds their cells held since the gateway
    started."""

    kernels: int
    cells_waiting: int
    gpus_committed: int
    gpu_seconds: float


@attrs.frozen
class ClusterSample:
    """The gauges at one moment: GPUs by state per host, kernels by state (every state,
    0 included), live replicas, and each user's figures."""

    gpus: Mapping[str, Mapping[str, int]]
    kernels: Mapping[str, int]
    replicas_alive: int
    users: Mapping[str, UserSample] = attrs.field(factory=dict)


class ClusterCollector(Collector):
    """Gauges read from ``sample()`` at every scrape."""

    def __init__(self, sample: Callable[[], ClusterSample]) -> None:
        self._sample = sample

    def collect(self) -> Iterator[Metric]:
        sample = self._sample()
        gpus = GaugeMetricFamily("nbos_gpus", "GPUs by host and state.", labels=["host", "state"])
        for host, states in sorted(sample.gpus.items()):
            for state, count in sorted(states.items()):
                gpus.add_metric([host, state], count)
        yield gpus
        yield GaugeMetricFamily(
            "nbos_kernels", "Kernels of the gateway.", value=sum(sample.kernels.values())
        )
        kernels = GaugeMetricFamily(
            "nbos_kernels_by_state",
            "Kernels by state (starting, idle, busy, waiting, degraded, recovering, dead).",
            labels=["state"],
        )
        for state, count in sample.kernels.items():
            kernels.add_metric([state], count)
        yield kernels
        yield GaugeMetricFamily(
            "nbos_replicas_alive", "Replica processes alive.", value=sample.replicas_alive
        )
        yield from _user_metrics(sample.users)


def _user_metrics(users: Mapping[str, UserSample]) -> Iterator[Metric]:
    """Per user (``user`` label; a kernel of nobody's is the user ``""``)."""
    kernels = GaugeMetricFamily("nbos_user_kernels", "Kernels per user.", labels=["user"])
    waiting = GaugeMetricFamily(
        "nbos_user_cells_waiting", "Cells waiting for GPUs per user.", labels=["user"]
    )
    held = GaugeMetricFamily(
        "nbos_user_gpus_committed", "GPUs held by a user's cells now.", labels=["user"]
    )
    seconds = CounterMetricFamily(
        "nbos_user_gpu_seconds",
        "GPU-seconds a user's cells held since the gateway started.",
        labels=["user"],
    )
    for user, figures in sorted(users.items()):
        kernels.add_metric([user], figures.kernels)
        waiting.add_metric([user], figures.cells_waiting)
        held.add_metric([user], figures.gpus_committed)
        seconds.add_metric([user], figures.gpu_seconds)
    yield from (kernels, waiting, held, seconds)


#: ``authorize(token)``: whether the token's holder may read the metrics.
Authorize = Callable[[str], Awaitable[bool]]


async def serve_metrics(
    address: str,
    registry: CollectorRegistry,
    *,
    authorize: Authorize | None = None,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Answer ``GET /metrics`` at ``address`` (``HOST:PORT``) with ``registry``, forever.

    ``task_status`` gets the bound ``HOST:PORT`` (port 0 picks one). Other paths get
    404, anything that is not a GET 400 (logged); one connection per request. With
    ``authorize``, a request must carry ``Authorization: Bearer TOKEN`` (or ``token
    TOKEN``) that it accepts: 401 without one, 403 for one it refuses (logged).
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError("gateway.metrics_address", address, "HOST:PORT")
    try:
        listener = await anyio.create_tcp_listener(local_host=host, local_port=int(port))
    except OSError as exc:
        raise TransportError(f"cannot bind the metrics endpoint {address}: {exc}") from exc
    async with listener:
        bound = listener.extra(anyio.abc.SocketAttribute.local_port)
        log.info("metrics at http://%s:%d/metrics", host, bound)
        task_status.started(f"{host}:{bound}")
        await listener.serve(lambda stream: _answer(stream, registry, authorize))


async def _answer(
    stream: anyio.abc.SocketStream, registry: CollectorRegistry, authorize: Authorize | None
) -> None:
    async with stream:
        try:
            with anyio.fail_after(_REQUEST_TIMEOUT_S):
                head = await BufferedByteReceiveStream(stream).receive_until(
                    b"\r\n\r\n", _MAX_REQUEST
                )
                refused = await _refusal(head, authorize)
                await stream.send(refused or _response(head, registry))
        except (TimeoutError, anyio.IncompleteRead, anyio.DelimiterNotFound, OSError) as exc:
            log.debug("metrics: request dropped: %r", exc)
        except anyio.BrokenResourceError:
            pass


def _response(head: bytes, registry: CollectorRegistry) -> bytes:
    method, _, rest = head.partition(b" ")
    path = rest.partition(b" ")[0].partition(b"?")[0]
    if method != b"GET":
        log.warning("metrics: refused a %r request", method[:16])
        return _http(400, b"text/plain", b"only GET\n")
    if path != b"/metrics":
        return _http(404, b"text/plain", b"see /metrics\n")
    return _http(200, CONTENT_TYPE_LATEST.encode(), generate_latest(registry))


async def _refusal(head: bytes, authorize: Authorize | None) -> bytes | None:
    """The answer refusing a request whose credentials ``authorize`` does not accept."""
    if authorize is None:
        return None
    token = ""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            token = token.strip() if scheme.lower() in ("bearer", "token") else ""
    if not token:
        log.warning("metrics: refused a request without a token")
        return _http(401, b"text/plain", b"a token is required\n")
    if not await authorize(token):
        log.warning("metrics: refused a request whose token may not read them")
        return _http(403, b"text/plain", b"not allowed\n")
    return None


def _http(status: int, content_type: bytes, body: bytes) -> bytes:
    reason = {
        200: b"OK",
        400: b"Bad Request",
        401: b"Unauthorized",
        403: b"Forbidden",
        404: b"Not Found",
    }[status]
    head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
    return head % (status, reason, content_type, len(body)) + body
