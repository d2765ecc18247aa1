"""ipykernel's own IOPub thread on a loopback PUB socket, and a SUB socket that reads what it
publishes: for the child scripts beside this file (run by path, so imported as a sibling)."""

from __future__ import annotations

import zmq
from ipykernel.iostream import IOPubThread
from jupyter_client.session import Session


def iopub_pair() -> tuple[IOPubThread, Session, zmq.Socket[bytes]]:
    """A started IOPub thread, an unsigned session, and a subscriber connected to it."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    iopub = IOPubThread(pub)
    iopub.start()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    return iopub, Session(key=b""), sub
