"""Request/reply over a lossy ``Transport``: numbered requests, resent until answered."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio
import attrs

from nbos.core.errors import HostUnreachableError, TransportError
from nbos.core.ids import PeerId
from nbos.core.transport import Transport
from nbos.core.wire import AnyMessage, encode

log = logging.getLogger(__name__)

Req = TypeVar("Req", bound=AnyMessage)
Rep = TypeVar("Rep", bound=AnyMessage)


@attrs.define
class _Slot(Generic[Rep]):
    done: anyio.Event = attrs.Factory(anyio.Event)
    reply: Rep | None = None


class RequestChannel(Generic[Req, Rep]):
    """Sends requests (``Req``) to agents and matches replies (``Rep``) to them by ``request_id``.

    A request is resent every ``retry_interval`` (the agent's handling is
    idempotent) until a reply arrives or ``timeout`` passes, which raises
    :class:`HostUnreachableError`. Replies nobody waits for (late, duplicated)
    are dropped. Once :meth:`close` was called (nothing delivers replies any
    more), every call waiting or to come raises :class:`HostUnreachableError` at once.
    """

    def __init__(
        self, transport: Transport, *, timeout: float, retry_interval: float, first_id: int = 1
    ) -> None:
        # ``first_id``: channels sharing one endpoint number from apart, so that a reply
        # type both may get (an ``AgentError``) cannot answer the other's request.
        self._transport = transport
        self._timeout = timeout
        self._retry = retry_interval
        self._ids = itertools.count(first_id)
        self._waiting: dict[int, _Slot[Rep]] = {}
        self._closed = False

    async def call(
        self, peer: PeerId, host: str, make: Callable[[int], Req], timeout: float | None = None
    ) -> Rep:
        """Send ``make(request_id)`` to ``peer`` (the agent of ``host``) and return its reply.

        ``timeout`` replaces the channel's for a request whose answer takes long (a stop).
        """
        if self._closed:
            raise HostUnreachableError(host, "no replies are received any more")
        request_id = next(self._ids)
        payload = encode(make(request_id))
        slot = self._waiting[request_id] = _Slot[Rep]()
        timeout = self._timeout if timeout is None else timeout
        try:
            with anyio.move_on_after(timeout):
                while not self._closed:
                    await self._send(peer, payload)
                    with anyio.move_on_after(self._retry):
                        await slot.done.wait()
                    if slot.reply is not None:
                        return slot.reply
        finally:
            del self._waiting[request_id]
        if self._closed:
            raise HostUnreachableError(host, "no replies are received any more")
        raise HostUnreachableError(host, f"no answer within {timeout:g} s")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Nothing delivers replies any more: end every call now, refuse later ones."""
        self._closed = True
        for slot in self._waiting.values():
            slot.done.set()

    def deliver(self, request_id: int, reply: Rep) -> bool:
        """Hand a reply to its waiting request; ``False`` if none waits for it."""
        slot = self._waiting.get(request_id)
        if slot is None or slot.reply is not None:
            return False
        slot.reply = reply
        slot.done.set()
        return True

    async def _send(self, peer: PeerId, payload: bytes) -> None:
        try:
            await self._transport.send(peer, payload)
        except TransportError as exc:
            # Counts as silence: the request is resent until the deadline.
            log.debug("request to %s not sent: %s", peer, exc)
