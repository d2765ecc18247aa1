"""Where an interrupt lands in a replica: in the user's code, before it, or before the cell.

Interrupts come on ipykernel's control thread, cells run on the main thread. SIGINT raises
``KeyboardInterrupt`` wherever the main thread is, so only user code may take it; an
interrupt that comes while the cell is claimed or waits for the cell before it is kept,
and the cell then ends without running. An interrupt that names a cell which has not
reached this replica yet (the front sends the cell on shell and the interrupt on control,
which nothing orders) is kept for it until it comes.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable

#: Interrupts kept for cells that have not come (yet): a few, as a front interrupts one
#: cell at a time; one whose cell never comes (it ended first) is forgotten in turn.
_EARLY_KEPT = 16


class CellInterrupts:
    """The interrupt state of one replica; every method is safe from either thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Counter[str] = Counter()
        self._early: OrderedDict[str, None] = OrderedDict()
        self._pending = False
        self._in_user_code = False

    def request_began(self, msg_id: str) -> None:
        """An ``execute_request`` came; an interrupt kept for it now applies."""
        with self._lock:
            self._requests[msg_id] += 1
            if msg_id in self._early:
                del self._early[msg_id]
                self._pending = True

    def request_ended(self, msg_id: str) -> None:
        with self._lock:
            self._requests[msg_id] -= 1
            if self._requests[msg_id] <= 0:
                del self._requests[msg_id]
            if not self._requests:
                self._pending = False

    def interrupt(self, cell: str | None, signal: Callable[[], None]) -> None:
        """A client's interrupt, of ``cell`` (an ``execute_request``'s msg_id) when the
        front names it: ``signal`` the main thread if user code runs, else keep it."""
        with self._lock:
            if cell is not None and cell not in self._requests:
                self._early[cell] = None
                if len(self._early) > _EARLY_KEPT:
                    self._early.popitem(last=False)
            elif self._in_user_code:
                signal()
            elif self._requests:
                self._pending = True

    def enter_user_code(self) -> bool:
        """The cell's user code starts, unless an interrupt came before: ``False`` then."""
        with self._lock:
            interrupted, self._pending = self._pending, False
            self._in_user_code = not interrupted
            return not interrupted

    def leave_user_code(self) -> None:
        with self._lock:
            self._in_user_code = False
