"""A nemesis that fills the disk under the gateway's state: a small tmpfs over it, full.

``DATA_DIR/gateway`` (where the gateway keeps ``state.json``) gets a tmpfs mounted over
it, its files copied in, and one file written until the tmpfs is full. While it is,
a kernel start is tried: the gateway must refuse it, or have it in its state file
before acknowledging it (``durable-start``). The heal deletes the file, unmounts the
tmpfs and copies back what the gateway wrote meanwhile, unless the gateway has already
written newer files underneath. Mounting needs root.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
from pathlib import Path

import anyio
import attrs

from nbos.chaos._checks import Violation
from nbos.chaos._deployment_faults import _check_hold, _hold
from nbos.chaos._nemesis import Strike
from nbos.chaos._target import Capability, ChaosKernel
from nbos.core.errors import KernelError, NemesisUnsupportedError, TransportError
from nbos.gateway.control_api import KernelInfo, ShutdownKernel, StartKernel, call

log = logging.getLogger(__name__)

#: The file that fills the tmpfs.
FILL = "nbos-chaos-fill"
_CHUNK = 64 * 1024
_START_TIMEOUT_S = 180.0


@attrs.frozen
class _Mounted:
    """A tmpfs over ``path``: fds of the directory under it and of the tmpfs, and the
    files copied in (name -> content)."""

    path: Path
    under: int
    over: int
    copied: dict[str, bytes]


@attrs.define
class FillDisk:
    """Fill the disk under the gateway's state for ``hold_s`` seconds (drawn): a tmpfs
    over ``data_dir/gateway``, full, and a kernel start tried meanwhile on the gateway
    at ``address``; then freed and unmounted."""

    data_dir: Path | None = None
    address: str | None = None
    hold_s: tuple[float, float] = attrs.field(default=(2.0, 6.0), validator=_check_hold)
    _mounted: _Mounted | None = attrs.field(default=None, init=False)

    @property
    def name(self) -> str:
        return "fill-disk"

    @property
    def needs(self) -> frozenset[Capability]:
        return frozenset({"gateway-data-dir", "gateway-control", "root"})

    async def strike(self, kernel: ChaosKernel, rng: random.Random) -> Strike:
        if self.data_dir is None or self.address is None:
            raise NemesisUnsupportedError(self.name, sorted(self.needs), kernel.where)
        path = self.data_dir / "gateway"
        self._mounted = await _mount_full(path)
        try:
            space = os.statvfs(path)
            found = await _try_start(self.address, path)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.heal(kernel, Strike("", ()))
            raise
        free = space.f_bavail * space.f_frsize
        hold = _hold(rng, self.hold_s)
        target = f"tmpfs over {path}, {free} bytes free, for {hold} s"
        return Strike(target, (), hold, found=found, checked=("durable-start",))

    async def heal(self, kernel: ChaosKernel, strike: Strike) -> None:
        mounted, self._mounted = self._mounted, None
        assert mounted is not None  # struck
        await _unmount(mounted)


async def _mount_full(path: Path) -> _Mounted:
    """Mount a tmpfs over ``path`` with its files, and fill it."""
    try:
        under = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise KernelError(f"no gateway state at {path} to put on a full disk: {exc}") from exc
    try:
        copied = _read_files(under)
        size_kib = sum(len(d) for d in copied.values()) // 512 + 256
        await _run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode=0700", "tmpfs", str(path)]
        )
    except BaseException:
        os.close(under)
        raise
    over = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    mounted = _Mounted(path, under, over, copied)
    try:
        for name, data in copied.items():
            _write(over, name, data)
        _fill(over)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _unmount(mounted)
        raise
    return mounted


async def _unmount(mounted: _Mounted) -> None:
    """Free and unmount the tmpfs, then copy back what the gateway changed on it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(FILL, dir_fd=mounted.over)
    try:
        # Detached at once (the gateway's next write goes underneath); the tmpfs stays
        # readable through ``over`` until closed.
        await _run(["umount", "--lazy", str(mounted.path)])
        now = _read_files(mounted.over)
        for name in sorted(set(now) | set(mounted.copied)):
            _copy_back(mounted, name, now.get(name))
    finally:
        os.close(mounted.over)
        os.close(mounted.under)


def _copy_back(mounted: _Mounted, name: str, content: bytes | None) -> None:
    """Put file ``name`` as the gateway left it on the tmpfs (``None``: deleted) under
    the mount point, unless it was not changed there or has changed underneath since."""
    before = mounted.copied.get(name)
    if content == before:
        return
    underneath = _read_files(mounted.under).get(name)
    if underneath != before:
        log.info("chaos: %s/%s written since the unmount: kept", mounted.path, name)
        return
    if content is None:
        os.unlink(name, dir_fd=mounted.under)
    else:
        _write(mounted.under, name, content)


def _read_files(directory: int) -> dict[str, bytes]:
    """The regular files of ``directory`` (an fd), by name; a subdirectory is refused
    (a mount over it would hide what is in it)."""
    files = {}
    for entry in os.listdir(directory):
        if entry == FILL:
            continue
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=directory)
        try:
            if not os.path.isfile(f"/proc/self/fd/{fd}"):
                raise KernelError(f"{entry} is not a regular file: not hidden under a tmpfs")
            with os.fdopen(os.dup(fd), "rb") as f:
                files[entry] = f.read()
        finally:
            os.close(fd)
    return files


def _write(directory: int, name: str, data: bytes) -> None:
    """Write ``name`` in ``directory`` (an fd) atomically, mode 0600, synced."""
    scratch = f".{name}.nbos-chaos"
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600, dir_fd=directory)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(scratch, name, src_dir_fd=directory, dst_dir_fd=directory)


def _fill(directory: int) -> None:
    """Write :data:`FILL` in ``directory`` (an fd) until the file system is full."""
    fd = os.open(FILL, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600, dir_fd=directory)
    chunk = b"\0" * _CHUNK
    try:
        while True:
            try:
                os.write(fd, chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    return
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)


async def _try_start(address: str, path: Path) -> tuple[Violation, ...]:
    """Start a kernel on the full disk: refused, or acknowledged with it on the disk."""
    try:
        reply = await call(address, StartKernel(), timeout=_START_TIMEOUT_S)
    except TransportError:
        return (Violation("not-durable", f"a start with {path} full got no answer"),)
    if not isinstance(reply, KernelInfo):
        log.info("chaos: a start on a full disk: %s", reply)
        return ()
    held = any(reply.kernel_id in d.decode(errors="replace") for d in _files_at(path).values())
    try:
        await call(address, ShutdownKernel(reply.kernel_id), timeout=_START_TIMEOUT_S)
    except TransportError as exc:
        log.warning("chaos: kernel %s not shut down: %s", reply.kernel_id, exc)
    if held:
        return ()
    detail = f"kernel {reply.kernel_id} acknowledged with {path} full, in no file there"
    return (Violation("not-durable", detail),)


def _files_at(path: Path) -> dict[str, bytes]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return _read_files(fd)
    finally:
        os.close(fd)


async def _run(argv: list[str]) -> None:
    result = await anyio.run_process(argv, check=False)
    if result.returncode != 0:
        detail = result.stderr.decode(errors="replace").strip()
        raise KernelError(f"{' '.join(argv)} exited with {result.returncode}: {detail}")
