"""Docker engines as hosts (aiodocker): each process is a container running the argv.

A host is a Docker engine endpoint (``unix:///var/run/docker.sock``,
``tcp://gpu-3:2376``, ...). Every container runs ``image`` (never pulled: it
must already exist on each engine) with the spec's argv as its command,
``NBOS_HOST_ID`` and the spec's environment, the configured bind mounts, the
host network (so loopback ZeroMQ works as with local processes) and, by
default, Docker's init as PID 1, which forwards signals to the argv process and
reaps zombies.

Signals: SIGSTOP and SIGCONT pause and unpause the container (the cgroup
freezer stops every process in it); any other signal is sent with ``docker
kill``. Exit statuses ``128 + N`` are reported as ``-N``, like ``subprocess``.
The exit status is learned by :meth:`DockerProcessHandle.wait`, so ``returncode``
stays ``None`` until a ``wait`` returned. ``aclose`` kills and removes every
container this backend created (found by a label naming this backend instance).

Needs the ``docker`` extra (``aiodocker``) and the asyncio event loop.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import signal
import tarfile
import uuid
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

import aiodocker
import aiohttp
import anyio
from aiodocker.containers import DockerContainer

from nbos.backends._common import (
    HandleBase,
    check_start,
    normalize_exit_status,
    process_env,
    with_running,
)
from nbos.core.compute_backend import ProcessSpec
from nbos.core.errors import BackendError, ConfigError, HostUnreachableError
from nbos.core.ids import HostId

logger = logging.getLogger(__name__)

#: Label naming the backend instance that created a container.
BACKEND_LABEL = "nbos.backend"
# aiodocker reports "cannot connect to the engine" as this pseudo HTTP status.
_UNREACHABLE = 900
_NOT_FOUND = 404
_CONFLICT = 409
_CLEANUP_TIMEOUT = 10.0
_SCHEMES = ("unix", "tcp", "http", "https")


class DockerProcessHandle(HandleBase):
    """A container running one process."""

    def __init__(self, host: HostId, container: DockerContainer, name: str) -> None:
        super().__init__(host)
        self._container = container
        #: The container's name (unique per backend instance).
        self.name = name
        self._returncode: int | None = None

    def __repr__(self) -> str:
        return f"<DockerProcessHandle host={self._host} name={self.name} rc={self._returncode}>"

    @property
    def container_id(self) -> str:
        container_id: str = self._container.id
        return container_id

    @property
    def returncode(self) -> int | None:
        """Exit status (``-N`` for signal ``N``) once a :meth:`wait` has returned, else ``None``."""
        return self._returncode

    async def wait(self) -> int:
        if self._returncode is None:
            try:
                result = await self._container.wait()
            except (aiodocker.DockerError, aiohttp.ClientError) as exc:
                raise _translate(self._host, f"wait for {self.name}", exc) from exc
            self._returncode = normalize_exit_status(int(result["StatusCode"]))
        return self._returncode

    async def host_pid(self) -> int:
        """The PID, on the engine's machine, of the container's first process (0 once it ended)."""
        try:
            state = await self._container.show()
        except (aiodocker.DockerError, aiohttp.ClientError) as exc:
            raise _translate(self._host, f"inspect {self.name}", exc) from exc
        return int(state["State"]["Pid"])

    async def signal(self, signum: int) -> None:
        """Pause/unpause for SIGSTOP/SIGCONT, else ``docker kill``; a no-op once it ended."""
        if self._returncode is not None:
            return
        try:
            if signum == signal.SIGSTOP:
                await self._container.pause()
            elif signum == signal.SIGCONT and await self._is_paused():
                await self._container.unpause()
            else:
                await self._container.kill(signal=str(int(signum)))
        except (aiodocker.DockerError, aiohttp.ClientError) as exc:
            if _already_in_state(exc, signum):
                logger.debug("signal %d to %s: nothing to do (%s)", signum, self.name, exc)
                return
            raise _translate(self._host, f"signal {signum} to {self.name}", exc) from exc

    async def _is_paused(self) -> bool:
        # Asked each time: the engine unpauses a container by itself when it kills it.
        state = await self._container.show()
        return bool(state["State"]["Paused"])


def _already_in_state(exc: Exception, signum: int) -> bool:
    """The container is not running, or (SIGCONT) was unpaused since we looked."""
    if not isinstance(exc, aiodocker.DockerError):
        return False
    if exc.status == _CONFLICT:
        return True
    # The engine unpauses a container it kills: between our look and our unpause,
    # a concurrent kill or stop can get there first. Under a CPU hog, runc was also seen
    # to refuse an unpause of a container the engine listed as paused, saying that the
    # process runs: what SIGCONT asks for.
    message = str(exc.message)
    return signum == signal.SIGCONT and any(
        reason in message for reason in ("is not paused", "cannot resume a running process")
    )


class DockerBackend:
    """Starts each process as a container on one of several Docker engines.

    ``hosts`` maps host ids to engine URLs. ``image`` is the image every container
    runs; ``mounts`` are bind mounts in Docker's ``SRC:DST[:ro]`` form (e.g. the
    repository and its virtual environment); ``network_mode`` defaults to ``host``;
    ``init`` runs Docker's init as PID 1; ``workdir`` and ``user`` set the
    container's working directory and user.
    """

    def __init__(
        self,
        hosts: Mapping[str, str],
        *,
        image: str,
        mounts: Sequence[str] = (),
        network_mode: str = "host",
        init: bool = True,
        workdir: str | None = None,
        user: str | None = None,
    ) -> None:
        if not hosts or not all(
            isinstance(u, str) and u.partition("://")[0] in _SCHEMES for u in hosts.values()
        ):
            expected = f"a non-empty mapping of host id to engine URL ({'/'.join(_SCHEMES)}://...)"
            raise ConfigError("hosts", hosts, expected)
        if not image:
            raise ConfigError("image", image, "the name of an image present on every engine")
        self._urls = {HostId(h): u for h, u in hosts.items()}
        self._image = image
        self._host_config: dict[str, Any] = {
            "Binds": list(mounts),
            "NetworkMode": network_mode,
            "Init": init,
        }
        self._extra: dict[str, Any] = {"WorkingDir": workdir or "", "User": user or ""}
        #: Labels every container of this instance; aclose removes what carries it.
        self.instance = uuid.uuid4().hex[:12]
        self._clients: dict[HostId, aiodocker.Docker] = {}
        self._handles: list[DockerProcessHandle] = []
        self._seq = itertools.count()
        self._closed = False

    @property
    def name(self) -> str:
        return "docker"

    def hosts(self) -> tuple[HostId, ...]:
        return tuple(self._urls)

    async def start(
        self,
        host: HostId,
        spec: ProcessSpec,
        *,
        files: Mapping[str, bytes] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> DockerProcessHandle:
        """Start ``spec`` in a new container on ``host``'s engine.

        ``files`` maps absolute paths to contents written into the container (mode
        0600, directories 0700) before it starts: secrets reach a remote engine so,
        never through its file system or the container's environment. ``labels``: more
        container labels (``docker ps --filter label=...`` finds it by them).
        """
        check_start(self.name, self._closed, host, self._urls, spec)
        client = self._client(host)
        name = f"nbos-{self.instance}-{next(self._seq)}"
        try:
            container = await self._create_and_start(
                client, name, host, spec, files=files or {}, labels=labels or {}
            )
        except (aiodocker.DockerError, aiohttp.ClientError) as exc:
            raise _translate(host, f"start {spec.argv[0]!r} ({self._image})", exc) from exc
        handle = DockerProcessHandle(host, container, name)
        self._handles = with_running(self._handles, handle)
        logger.debug("started %r on %s: container %s", spec.label, host, name)
        return handle

    async def adopt(self, host: HostId, container_id: str) -> DockerProcessHandle | None:
        """A handle on container ``container_id`` of ``host`` (started by an earlier
        instance, running or ended), or ``None`` once it is gone."""
        if host not in self._urls:
            raise HostUnreachableError(host, f"not a host of the {self.name} backend")
        try:
            container = await self._client(host).containers.get(container_id)
        except (aiodocker.DockerError, aiohttp.ClientError) as exc:
            if isinstance(exc, aiodocker.DockerError) and exc.status == _NOT_FOUND:
                return None
            raise _translate(host, f"inspect {container_id[:12]}", exc) from exc
        return DockerProcessHandle(host, container, str(container["Name"]).lstrip("/"))

    async def detach(self) -> None:
        """Close the engine clients and leave every container running: ending them is the
        caller's business (:meth:`remove`, by container id)."""
        self._closed = True
        self._handles.clear()
        for client in self._clients.values():
            await client.close()
        self._clients.clear()

    async def remove(self, host: HostId, container_id: str, grace: float = 10.0) -> None:
        """Stop container ``container_id`` on ``host`` (SIGTERM, SIGKILL after ``grace``)
        and remove it; nothing if it is gone already."""
        if host not in self._urls:
            raise HostUnreachableError(host, f"not a host of the {self.name} backend")
        container = self._client(host).containers.container(container_id)
        try:
            await container.stop(t=max(int(grace), 0))
            await container.delete(force=True)
        except (aiodocker.DockerError, aiohttp.ClientError) as exc:
            if isinstance(exc, aiodocker.DockerError) and exc.status == _NOT_FOUND:
                return
            raise _translate(host, f"remove {container_id[:12]}", exc) from exc

    async def aclose(self) -> None:
        """Kill every container still running, then remove every container this instance made."""
        self._closed = True
        with anyio.move_on_after(_CLEANUP_TIMEOUT) as scope:
            for handle in self._handles:
                if handle.returncode is None:
                    await _quietly(handle.signal(signal.SIGKILL), handle.host)
                    # Learn the status before the container (and with it the status) goes.
                    await _quietly(handle.wait(), handle.host)
            for host, client in self._clients.items():
                await _quietly(self._remove_all(client), host)
        if scope.cancelled_caught:
            logger.error("docker cleanup took over %.0fs; containers may remain", _CLEANUP_TIMEOUT)
        self._handles.clear()
        for client in self._clients.values():
            await client.close()
        self._clients.clear()

    def _client(self, host: HostId) -> aiodocker.Docker:
        if host not in self._clients:
            self._clients[host] = aiodocker.Docker(url=self._urls[host])
        return self._clients[host]

    async def _create_and_start(
        self,
        client: aiodocker.Docker,
        name: str,
        host: HostId,
        spec: ProcessSpec,
        *,
        files: Mapping[str, bytes],
        labels: Mapping[str, str],
    ) -> DockerContainer:
        own = {BACKEND_LABEL: self.instance, "nbos.host": host, "nbos.label": spec.label}
        config = {
            "Image": self._image,
            "Cmd": list(spec.argv),
            "Env": [f"{k}={v}" for k, v in process_env(host, spec.env).items()],
            "Labels": {**labels, **own},
            "HostConfig": self._host_config,
            **self._extra,
        }
        try:
            container = await client.containers.create(config, name=name)
            if files:
                await container.put_archive("/", _tarball(files))  # type: ignore[no-untyped-call]
            await container.start()
        except BaseException:
            # The engine may have created (or started) it even if the request was interrupted.
            with anyio.CancelScope(shield=True), anyio.move_on_after(_CLEANUP_TIMEOUT):
                await _quietly(client.containers.container(name).delete(force=True), host)
            raise
        return container

    async def _remove_all(self, client: aiodocker.Docker) -> None:
        filters = json.dumps({"label": [f"{BACKEND_LABEL}={self.instance}"]})
        for container in await client.containers.list(all=True, filters=filters):
            await container.delete(force=True)


def _tarball(files: Mapping[str, bytes]) -> bytes:
    """``files`` (absolute paths) as a tar archive to unpack at ``/``, private to the owner."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        made: set[str] = set()
        for path, data in files.items():
            parts = path.strip("/").split("/")
            for i in range(1, len(parts)):
                directory = "/".join(parts[:i])
                if directory not in made:
                    made.add(directory)
                    entry = tarfile.TarInfo(directory)
                    entry.type, entry.mode = tarfile.DIRTYPE, 0o700
                    tar.addfile(entry)
            entry = tarfile.TarInfo("/".join(parts))
            entry.size, entry.mode = len(data), 0o600
            tar.addfile(entry, io.BytesIO(data))
    return out.getvalue()


def _translate(host: HostId, action: str, exc: Exception) -> BackendError:
    status = exc.status if isinstance(exc, aiodocker.DockerError) else _UNREACHABLE
    message = exc.message if isinstance(exc, aiodocker.DockerError) else str(exc)
    logger.warning("docker on %s: %s failed: %s", host, action, message)
    if status == _UNREACHABLE:
        return HostUnreachableError(host, f"Docker engine: {message}")
    return BackendError(f"docker on {host}: {action} failed ({status}): {message}")


async def _quietly(work: Awaitable[object], host: HostId) -> None:
    """Await ``work`` (a cleanup step); a 404 means done already, other errors are logged."""
    try:
        await work
    except (aiodocker.DockerError, aiohttp.ClientError, BackendError) as exc:
        if not (isinstance(exc, aiodocker.DockerError) and exc.status == _NOT_FOUND):
            logger.warning("docker cleanup on %s failed: %s", host, exc)
