"""The API's kernels: one per ``POST /api/kernels``, its id stable across restarts.

An :class:`ApiKernel` is what Jupyter Server sees: an id, a kernelspec name,
``last_activity``, ``execution_state`` and ``connections``. Behind it runs one nbos
kernel of the gateway (3 replicas and a front); a restart shuts that kernel down and
starts a fresh one (a fresh namespace, as a restarted Jupyter kernel has), which the
clients' channels follow. The API id is the first nbos kernel's id; the current one
is in the model's ``nbos.kernel_id``, its state (``docs/kernel.md``, Kernel states) in
``nbos.state``.

A start that waits for a host the autoscaler adds (``docs/deploy.md``, Admission) is answered at
once: the kernel is ``starting``, the model's ``nbos.waiting`` says why, and a client's
WebSocket (with what it sends on it) and its requests wait for the start, at most
:data:`START_WAIT_S`, then fail with the start's error.

Activity is read the way Jupyter Server reads it: every IOPub message is activity,
and ``status`` messages say whether the kernel is busy, except those answering requests
that tools send on their own (``kernel_info_request`` and the like). The model's
``execution_state`` keeps Jupyter's own words: that activity where the nbos state leaves
it open (``idle``, ``degraded``), ``dead`` for a dead kernel, ``busy`` for one that runs
or waits to run a cell or is recovering
(:func:`~nbos.gateway._kernel_state.jupyter_state`).
"""

from __future__ import annotations

import datetime
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import anyio
import anyio.abc
import msgspec
import zmq
import zmq.asyncio

from nbos.core.errors import ConfigError, KernelError, NbosError, UnknownKernelError
from nbos.core.identity import User, UserName
from nbos.core.ids import KernelId, new_kernel_id
from nbos.gateway._kernel import Kernel
from nbos.gateway._kernel_manager import HOST_WAIT_S, KernelManager
from nbos.gateway._kernel_state import JupyterState, KernelState, jupyter_state
from nbos.gateway.auth import acting_for
from nbos.gateway.http._channels import ChannelBridge, Sink
from nbos.gateway.http._specs import spec_name
from nbos.kernel.jupyter_requests import channel_url, control_request, session_for

log = logging.getLogger(__name__)

_INTERRUPT_TIMEOUT_S = 30.0
#: How long what a client asks of a kernel still starting waits for it: the wait for a
#: host, and then the start itself.
START_WAIT_S = HOST_WAIT_S + 120.0
#: Requests whose busy/idle are not the user's activity (tools send them by themselves).
_UNTRACKED = frozenset(
    {"kernel_info_request", "comm_info_request", "interrupt_request", "shutdown_request"}
)
#: A kernel's output (not its status) moves its last activity at most this often: checking
#: every message of a flood of output cost the gateway a quarter of its time.
_OUTPUT_ACTIVITY_EVERY_S = 1.0
#: Only variables named so reach the replicas (as Enterprise Gateway's ``KERNEL_*``).
_ENV_NAME = re.compile(r"KERNEL_[A-Za-z0-9_]*")


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class ApiKernel:
    """One kernel of the API: its current nbos kernel, its activity, its clients."""

    def __init__(
        self,
        name: str,
        gpus: int,
        env: Mapping[str, str],
        owner: str,
        kernel: Kernel | None = None,
    ) -> None:
        # A kernel the gateway holds already (taken back) keeps its id; a new one gets
        # the id its start will be made under.
        self.kernel_id: str = new_kernel_id() if kernel is None else kernel.kernel_id
        self.name = name
        self.gpus = gpus
        self.env = dict(env)
        self.owner = owner
        #: The nbos kernel; ``None`` while its first start runs.
        self._kernel: Kernel | None = kernel
        #: Set once the first start ended, started or not (then ``start_error`` says why).
        self.started = anyio.Event()
        if kernel is not None:
            self.started.set()
        self.start_error: Exception | None = None
        #: Why the first start waits (for a host), while it does.
        self.waiting: str | None = None
        self.generation = 0
        #: What the kernel's IOPub last said (``idle``, ``busy``), or ``restarting``.
        self.activity = "idle"
        self.last_activity = _now()
        #: Open WebSockets (what Jupyter Server calls connections).
        self.sinks: dict[Sink, ChannelBridge] = {}
        #: The bridge of the one session whose client went away, holding its messages.
        self.detached: ChannelBridge | None = None
        self.ending = False
        self.lock = anyio.Lock()
        self._changed = anyio.Event()
        #: The first start's scope, to call it off while it waits for a host.
        self.start_scope: anyio.CancelScope | None = None

    @property
    def kernel(self) -> Kernel:
        """The nbos kernel; :class:`KernelError` while it starts (:meth:`wait_started`)."""
        if self._kernel is None:
            raise KernelError(f"kernel {self.kernel_id} is starting: {self.waiting or 'starting'}")
        return self._kernel

    @kernel.setter
    def kernel(self, kernel: Kernel) -> None:
        self._kernel = kernel

    @property
    def is_started(self) -> bool:
        return self._kernel is not None

    async def wait_started(self) -> Kernel:
        """The nbos kernel once its first start ended; :class:`KernelError` if it failed, or
        if it still starts after :data:`START_WAIT_S`."""
        with anyio.move_on_after(START_WAIT_S):
            await self.started.wait()
        if self._kernel is not None:
            return self._kernel
        if self.start_error is not None:
            raise KernelError(f"kernel {self.kernel_id} did not start: {self.start_error}")
        raise KernelError(
            f"kernel {self.kernel_id} still starts after {START_WAIT_S:g} s ({self.waiting})"
        )

    @property
    def connection_info(self) -> Mapping[str, Any]:
        return self.kernel.connection_info

    @property
    def state(self) -> KernelState:
        """The nbos kernel's state; ``starting`` while it starts or the API restarts it."""
        if self._kernel is None or self.activity == "restarting":
            return "starting"
        return self._kernel.state

    @property
    def execution_state(self) -> JupyterState:
        """The kernel's state in Jupyter's words (what Jupyter Server and its culler read)."""
        return jupyter_state(self.state, self.activity)

    def model(self) -> dict[str, Any]:
        state = self.state
        kernel = self._kernel
        nbos: dict[str, Any] = {
            "kernel_id": kernel.kernel_id if kernel is not None else self.kernel_id,
            "gpus": self.gpus,
            "state": state,
            "replicas_alive": len(kernel.front.alive) if kernel is not None else 0,
        }
        if kernel is None and self.waiting is not None:
            nbos["waiting"] = self.waiting
        return {
            "id": self.kernel_id,
            "name": self.name,
            "last_activity": self.last_activity.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "execution_state": jupyter_state(state, self.activity),
            "connections": len(self.sinks),
            "nbos": nbos,
        }

    def touch(self) -> None:
        self.last_activity = _now()

    async def wait_changed(self, generation: int) -> None:
        while self.generation == generation and not self.ending:
            await self._changed.wait()

    def changed(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


class ApiKernels:
    """Every kernel of the API, over the gateway's :class:`~nbos.gateway.KernelManager`."""

    def __init__(
        self,
        kernel_manager: KernelManager,
        tg: anyio.abc.TaskGroup,
        ctx: zmq.asyncio.Context,
        max_gpus: Callable[[], int],
        backlog_bytes: int,
    ) -> None:
        self.kernel_manager = kernel_manager
        self.max_gpus = max_gpus
        #: What a client may have not yet taken before its output is dropped.
        self.backlog_bytes = backlog_bytes
        self._tg = tg
        self._ctx = ctx
        self._kernels: dict[str, ApiKernel] = {}

    def __iter__(self) -> Iterator[ApiKernel]:
        return iter(list(self._kernels.values()))

    def api_id(self, kernel_id: str) -> str | None:
        """The API's id of the nbos kernel ``kernel_id`` (an API restart starts a new nbos
        kernel behind the same API id); ``None`` for a kernel not started through the API."""
        return next(
            (api.kernel_id for api in self if api.is_started and api.kernel.kernel_id == kernel_id),
            None,
        )

    def visible(self, user: User) -> list[ApiKernel]:
        """The kernels ``user`` may see: their own, or all for an admin."""
        return [api for api in self if user.may_see(api.owner)]

    def get(self, kernel_id: str, user: User) -> ApiKernel:
        """``user``'s kernel ``kernel_id``; :class:`UnknownKernelError` for none, and for
        another user's (as if it did not exist)."""
        api = self._kernels.get(kernel_id)
        if api is None or api.ending or not user.may_see(api.owner):
            raise UnknownKernelError(KernelId(kernel_id))
        return api

    async def start(self, name: str, gpus: int, env: Mapping[str, Any], user: User) -> ApiKernel:
        """Start a kernel of kernelspec ``name`` (``gpus`` per cell) for ``user``; ``env``
        as requested, but ``KERNEL_USERNAME`` is the kernel's owner: ``user``, or for an
        admin the user it names (impersonation, as Enterprise Gateway's)."""
        passed = _kernel_env(env)
        named = passed.get("KERNEL_USERNAME") if user.is_admin else None
        owner = acting_for(user, _user_name(named) if named else None)
        passed["KERNEL_USERNAME"] = owner
        api = ApiKernel(name, gpus, passed, owner)
        self._kernels[api.kernel_id] = api
        answered = anyio.Event()

        def waits(why: str) -> None:
            api.waiting = why
            answered.set()

        self._tg.start_soon(self._first_start, api, waits)
        await _first(api.started.wait, answered.wait)
        if api.start_error is not None:
            raise api.start_error
        if not api.is_started:
            log.info("kernel %s (%s) for %s: %s", api.kernel_id, name, owner, api.waiting)
        return api

    async def _first_start(self, api: ApiKernel, waits: Callable[[str], None]) -> None:
        """Start ``api``'s nbos kernel (under its API id) and watch it; a start that fails
        forgets ``api``, which the clients waiting for it hear (:meth:`ApiKernel.wait_started`)."""
        try:
            with anyio.CancelScope() as api.start_scope:
                api.kernel = await self.kernel_manager.start_kernel(
                    gpus=api.gpus,
                    env=api.env,
                    owner=api.owner,
                    kernel_id=KernelId(api.kernel_id),
                    on_wait=waits,
                )
            if api.start_scope.cancelled_caught:
                api.start_error = KernelError("it was shut down while it started")
            else:
                api.touch()  # idle from its start on, not from the request (the culler)
        except NbosError as exc:
            api.start_error = exc
            if api.waiting is not None:  # answered already: logged here
                log.warning("kernel %s did not start: %s", api.kernel_id, exc)
        finally:
            api.waiting = None
            api.started.set()
            if not api.is_started:
                self._let_go(api)
        if not api.is_started:
            return
        if api.ending:  # deleted while it started
            await api.kernel.shutdown()
            return
        self._tg.start_soon(self._supervise, api)
        log.info("kernel %s (%s) started for %s", api.kernel_id, api.name, api.owner)

    def take_back(self) -> None:
        """Serve the kernels the gateway holds already: at the API's start, those it took
        back from its data dir after a restart, so that their clients (JupyterLab through
        Jupyter Server) reconnect to them. Each comes back under its nbos kernel id, which
        is its API id unless the API restarted it (a restart's API id lives in memory
        only), with the kernelspec of its GPUs per cell; a kernel started through the
        control API is then served too."""
        for kernel in self.kernel_manager.kernels:
            if kernel.kernel_id in self._kernels:
                continue
            name = spec_name(kernel.gpus)
            api = ApiKernel(
                name, kernel.gpus, {"KERNEL_USERNAME": kernel.owner}, kernel.owner, kernel
            )
            self._kernels[api.kernel_id] = api
            self._tg.start_soon(self._supervise, api)
            log.info("kernel %s (%s) of %s taken back", api.kernel_id, name, kernel.owner)

    async def restart(self, api: ApiKernel) -> None:
        """A fresh nbos kernel behind ``api`` (the old one shut down first)."""
        await api.wait_started()
        async with api.lock:
            if api.ending:  # deleted while this waited for the lock
                raise UnknownKernelError(KernelId(api.kernel_id))
            # Refused before the old kernel goes: an overloaded gateway keeps it running.
            self.kernel_manager.admission.check()
            await api.kernel.retire()
            api.activity = "restarting"
            old = api.kernel
            await old.shutdown()
            try:
                api.kernel = await self.kernel_manager.start_kernel(
                    gpus=api.gpus, env=api.env, owner=old.owner
                )
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self._forget(api)
                raise
            api.generation += 1
            api.activity = "idle"
            api.touch()
            api.changed()
            log.info("kernel %s restarted: nbos kernel %s", api.kernel_id, api.kernel.kernel_id)

    async def interrupt(self, api: ApiKernel) -> None:
        """``interrupt_request`` through the front (which sends it to the cell's executor)."""
        await api.wait_started()
        async with api.lock:
            reply = await control_request(
                self._ctx, api.connection_info, "interrupt_request", {}, _INTERRUPT_TIMEOUT_S
            )
        if reply is None:
            raise KernelError(f"kernel {api.kernel_id} did not answer an interrupt")

    async def shutdown(self, api: ApiKernel) -> None:
        if not api.is_started:
            # Still starting: the start is called off (or, placed already, shut down
            # once it ends).
            self._let_go(api)
            if api.start_scope is not None and api.waiting is not None:
                api.start_scope.cancel()
            log.info("kernel %s shut down while it started", api.kernel_id)
            return
        async with api.lock:
            if api.ending:
                return
            await self._forget(api)
            log.info("kernel %s shut down", api.kernel_id)

    def close(self) -> None:
        """Close every client's channels; the kernels are the kernel manager's to stop or
        to leave running (a gateway with a data dir leaves them for its next start)."""
        for api in list(self._kernels.values()):
            self._let_go(api)

    # --- clients ----------------------------------------------------------------

    async def connect(self, api: ApiKernel, sink: Sink, session_key: str) -> ChannelBridge:
        """A bridge for a new WebSocket: that of ``session_key`` if it has one, else a new
        one. Waits for a kernel that starts (:meth:`ApiKernel.wait_started`).

        A session's bridge is the one its older WebSocket left held, or the one that
        WebSocket still has: a client back from a lost network can come before the
        gateway noticed its old connection end. The newer connection replaces the older
        one, as in Jupyter Server: the older is closed and the newer takes over its bridge
        (its replies, its stdin and what was held).
        """
        await api.wait_started()
        bridge = self._take_over(api, session_key) if session_key else None
        if bridge is None:
            held, api.detached = api.detached, None
            if held is not None and session_key and held.session_key == session_key:
                bridge = held
            else:
                if held is not None:  # one session is held per kernel, as Jupyter Server does
                    held.close()
                bridge = ChannelBridge(api, session_key, self._ctx, self.backlog_bytes)
                await self._tg.start(bridge.run)
        api.sinks[sink] = bridge
        bridge.attach(sink)
        return bridge

    def _take_over(self, api: ApiKernel, session_key: str) -> ChannelBridge | None:
        """The bridge of ``session_key``'s open WebSocket, which is closed; ``None`` if none."""
        for old, bridge in api.sinks.items():
            if bridge.session_key == session_key:
                del api.sinks[old]
                bridge.detach()
                old.close()
                log.warning(
                    "kernel %s: session %s connected again: its older connection is replaced",
                    api.kernel_id,
                    session_key,
                )
                return bridge
        return None

    def disconnect(self, api: ApiKernel, sink: Sink) -> None:
        """A WebSocket closed: its session's messages are held if it named one."""
        bridge = api.sinks.pop(sink, None)
        if bridge is None:
            return
        if not bridge.session_key or api.ending:
            bridge.close()
            return
        bridge.detach()
        if api.detached is not None:
            api.detached.close()
        api.detached = bridge
        log.info(
            "kernel %s: session %s went away: holding its messages",
            api.kernel_id,
            bridge.session_key,
        )

    # --- background ---------------------------------------------------------------

    async def cull_idle(self, timeout: float) -> None:
        """Shut down kernels with no client that were idle for ``timeout`` seconds (not
        one that runs, waits to run a cell or recovers: it shows ``busy``)."""
        every = min(max(timeout / 2, 0.5), 60.0)
        while True:
            await anyio.sleep(every)
            now = _now()
            for api in self:
                idle_s = (now - api.last_activity).total_seconds()
                if api.sinks or api.execution_state in ("busy", "starting") or idle_s < timeout:
                    continue
                log.info("kernel %s idle for %.0fs with no client: culled", api.kernel_id, idle_s)
                await self.shutdown(api)

    async def _supervise(self, api: ApiKernel) -> None:
        """Watch ``api``'s activity; forget it once its nbos kernel ended by itself."""
        while not api.ending:
            generation, kernel = api.generation, api.kernel
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_activity, api, kernel)
                await _first(kernel.closed.wait, partial(api.wait_changed, generation))
                tg.cancel_scope.cancel()
            if api.generation != generation or api.ending:
                continue
            if api.activity == "restarting":
                await api.wait_changed(generation)
                continue
            # A client's shutdown_request, or the kernel lost its quorum.
            log.info("kernel %s ended", api.kernel_id)
            async with api.lock:
                await self._forget(api)

    async def _watch_activity(self, api: ApiKernel, kernel: Kernel) -> None:
        info = kernel.connection_info
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(channel_url(info, "iopub"))
        try:
            await self._read_activity(api, kernel, sock)
        except zmq.ZMQError:
            log.exception("kernel %s: activity no longer watched", api.kernel_id)
        finally:
            sock.close(0)

    async def _read_activity(
        self, api: ApiKernel, kernel: Kernel, sock: zmq.asyncio.Socket
    ) -> None:
        session = session_for(kernel.connection_info)
        output_seen_at = -_OUTPUT_ACTIVITY_EVERY_S
        while True:
            # Not copied out of ZeroMQ's buffers unless read: most output is not.
            frames = await sock.recv_multipart(copy=False)
            # The front's topic names the message's type: ``kernel.<id>.<msg_type>``.
            is_status = frames[0].bytes.endswith(b".status")
            if not is_status:
                if time.monotonic() - output_seen_at < _OUTPUT_ACTIVITY_EVERY_S:
                    continue
                output_seen_at = time.monotonic()
            try:
                _, parts = session.feed_identities([frame.bytes for frame in frames])
                msg = session.deserialize(parts, content=is_status)
            except (ValueError, TypeError, KeyError):
                continue  # the bridges log it
            if msg["parent_header"].get("msg_type") in _UNTRACKED:
                continue
            api.touch()
            if msg["msg_type"] == "status" and api.kernel is kernel:
                api.activity = str(msg["content"].get("execution_state", "idle"))

    async def _forget(self, api: ApiKernel) -> None:
        await api.kernel.retire()  # a shutdown the gateway could not record is refused
        self._let_go(api)
        await api.kernel.shutdown()

    def _let_go(self, api: ApiKernel) -> None:
        api.ending = True
        api.changed()
        self._kernels.pop(api.kernel_id, None)
        for bridge in [*api.sinks.values(), api.detached]:
            if bridge is not None:
                bridge.close()
        for sink in list(api.sinks):
            sink.close()
        api.sinks.clear()


def _user_name(name: str) -> str:
    """``name`` if it is one a user may have; :class:`ConfigError` if not."""
    try:
        return msgspec.convert(name, UserName)
    except msgspec.ValidationError as exc:
        raise ConfigError("env.KERNEL_USERNAME", name, f"a user name ({exc})") from None


def _kernel_env(env: Mapping[str, Any]) -> dict[str, str]:
    """The request's ``KERNEL_*`` variables; :class:`ConfigError` for a value not a string."""
    passed = {}
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name):
            log.debug("variable %s of a kernel request not passed on (not KERNEL_*)", name)
            continue
        if not isinstance(value, str) or "\0" in value:
            raise ConfigError(f"env.{name}", value, "a string")
        passed[name] = value
    return passed


async def _first(*waits: Callable[[], Any]) -> None:
    """Return once the first of ``waits`` returned."""
    async with anyio.create_task_group() as tg:

        async def run(wait: Callable[[], Any]) -> None:
            await wait()
            tg.cancel_scope.cancel()

        for wait in waits:
            tg.start_soon(run, wait)
