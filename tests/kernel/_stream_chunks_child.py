"""A flood on the replica's ``sys.stdout`` (``ReplicaOutStream``) over ipykernel's own
IOPub thread.

Usage: ``python _stream_chunks_child.py``. Writes 2.5 Mi characters in 1 KiB lines,
flushes, and prints one JSON object: the length of each ``stream`` message IOPub published
and whether their texts, joined, are what was written.
"""

from __future__ import annotations

import json
import sys
import time

from _iopub_pair import iopub_pair

from nbos.kernel.replica._output import ReplicaOutStream

iopub, session, sub = iopub_pair()
time.sleep(0.3)  # the subscription reaches the publisher

stream = ReplicaOutStream(session, iopub, "stdout", watchfd=False)
stream.set_parent({"msg_id": "flood"})
line = "x" * 1023 + "\n"
for _ in range(2560):
    stream.write(line)
stream.flush()

texts = []
while sub.poll(1000):
    _, frames = session.feed_identities(sub.recv_multipart())
    msg = session.deserialize(frames)
    if msg["msg_type"] == "stream":
        texts.append(msg["content"]["text"])
report = {"lengths": [len(t) for t in texts], "whole": "".join(texts) == line * 2560}
print(json.dumps(report), file=sys.__stdout__)
