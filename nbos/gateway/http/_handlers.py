"""The REST side of the Kernel Gateway API (tornado handlers), and the token check.

Errors answer as Jupyter Server's do: a status and ``{"message": ..., "reason": ...}``;
a kernel start the gateway could not record answers 507 (a full disk) or 503, and one it
has no room for now a 503 with ``Retry-After`` (whole seconds).
Every handler, the WebSocket's too, first authenticates its request's token
(:class:`ApiHandler`); a user sees and acts on their own kernels only, another's is a 404
as if absent, an admin sees all (``docs/users.md``).
"""

from __future__ import annotations

import errno
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Annotated, Any

import msgspec
from tornado import web

from nbos._version import __version__
from nbos.core.errors import (
    ConfigError,
    ForbiddenError,
    HostUnreachableError,
    IdentityProviderError,
    NbosError,
    OverloadedError,
    PlacementError,
    StateWriteError,
    UnauthorizedError,
    UnknownKernelError,
)
from nbos.core.identity import User
from nbos.core.private_files import redact_tokens
from nbos.gateway.auth import Authenticator
from nbos.gateway.http._kernels import ApiKernel, ApiKernels
from nbos.gateway.http._specs import DEFAULT_SPEC, spec_gpus, spec_model, specs_model
from nbos.metrics import ClusterEvent, events

log = logging.getLogger(__name__)
#: When to ask again after a 503 that is no admission's refusal (a host unreachable now).
_RETRY_AFTER_S = 5
_access_log = logging.getLogger("tornado.access")


#: A kernelspec name (``nbos``, ``nbos-gpu-N``): a longer one is no spec of ours.
_SpecName = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
#: The environment a start asks for: at most so many variables, their names so long
#: (only ``KERNEL_*`` strings reach the kernel, see ``_kernels``).
_Env = Annotated[
    dict[Annotated[str, msgspec.Meta(max_length=256)], Any], msgspec.Meta(max_length=256)
]


class _StartRequest(msgspec.Struct):
    """``POST /api/kernels``: other fields (``path``) are Jupyter Server's own business."""

    name: _SpecName = DEFAULT_SPEC
    env: _Env = msgspec.field(default_factory=dict)


class _Empty(msgspec.Struct):
    """The body of ``interrupt`` and ``restart``: an object (Jupyter Server sends ``{}``)."""


def log_request(handler: web.RequestHandler) -> None:
    """Tornado's access log line for a finished request (``log_function``), any token
    in its query string redacted: 4xx and 5xx are logged as tornado does, with the URI."""
    status = handler.get_status()
    level = logging.INFO if status < 400 else logging.WARNING if status < 500 else logging.ERROR
    request = handler.request
    summary = redact_tokens(f"{request.method} {request.uri} ({request.remote_ip})")
    _access_log.log(level, "%d %s %.2fms", status, summary, 1000.0 * request.request_time())


class RedactedLogs(web.RequestHandler):
    """Tornado's access log and its log of a handler's exceptions quote the request: a
    token in its query string (``?token=``) is redacted from both."""

    def _request_summary(self) -> str:
        return redact_tokens(super()._request_summary())

    def log_exception(
        self,
        typ: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(value, web.HTTPError):
            super().log_exception(typ, value, tb)
        else:  # tornado's own adds the request's repr, its URI unredacted
            log.error("uncaught exception %s", self._request_summary(), exc_info=value)


class ApiHandler(RedactedLogs):
    """Authentication and JSON errors for every route."""

    kernels: ApiKernels
    authenticator: Authenticator
    user: User

    def initialize(self, kernels: ApiKernels, authenticator: Authenticator) -> None:
        self.kernels = kernels
        self.authenticator = authenticator

    async def prepare(self) -> None:
        self.user = await authenticate(self, self.authenticator)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, web.HTTPError) and isinstance(exc.__cause__, OverloadedError):
            self.set_header("Retry-After", str(math.ceil(exc.__cause__.retry_after_s)))
        elif status_code == 503:
            self.set_header("Retry-After", str(_RETRY_AFTER_S))
        self.set_header("Content-Type", "application/json")
        self.finish(msgspec.json.encode(error_body(self, kwargs)))

    def reply(self, body: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(msgspec.json.encode(body))

    def body_as(self, kind: type[Any]) -> Any:
        """The request body decoded as ``kind``; 400 if it is not one (empty: the defaults)."""
        try:
            return msgspec.json.decode(self.request.body or b"{}", type=kind)
        # msgspec lets a string that is not UTF-8 raise UnicodeDecodeError (msgspec#714).
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            log.warning("%s %s: malformed body: %s", self.request.method, self.request.path, exc)
            raise web.HTTPError(400, f"malformed body: {exc}") from exc

    def kernel(self, kernel_id: str) -> ApiKernel:
        with api_errors():
            return self.kernels.get(kernel_id, self.user)


def error_body(handler: web.RequestHandler, write_error_kwargs: dict[str, Any]) -> dict[str, str]:
    """An error's JSON answer. An exception that is no ``HTTPError`` is a bug of the
    gateway's (tornado logged its traceback and answers 500): its type and message are told,
    and the server goes on with its other requests."""
    exc = write_error_kwargs.get("exc_info", (None, None, None))[1]
    if isinstance(exc, web.HTTPError):
        message = exc.log_message or ""
    elif exc is not None:
        message = f"the gateway failed this request: {type(exc).__name__}: {exc}"
    else:
        message = ""
    return {"message": message, "reason": handler._reason}


async def authenticate(handler: web.RequestHandler, authenticator: Authenticator) -> User:
    """Who makes the request (``Authorization: token X`` or ``?token=X``): 401 without a
    token, 403 with one nobody has, 503 when an identity provider cannot tell now."""
    scheme, _, given = handler.request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() not in ("token", "bearer"):
        given = handler.get_query_argument("token", "")
    who = f"{handler.request.method} {handler.request.path} from {handler.request.remote_ip}"
    if not given.strip():
        _refused(who, "no token")
        raise web.HTTPError(401, "a token is required")
    try:
        return await authenticator.authenticate(given.strip())
    except UnauthorizedError as exc:
        _refused(who, str(exc))
        raise web.HTTPError(403, "wrong token") from exc
    except IdentityProviderError as exc:
        _refused(who, str(exc))
        raise web.HTTPError(503, f"cannot tell who you are now: {exc}") from exc


def _refused(who: str, why: str) -> None:
    log.warning("refused %s: %s", who, why)
    events().happened(ClusterEvent("refused", f"HTTP: refused {who}: {why}"))


@contextmanager
def api_errors() -> Iterator[None]:
    """nbos errors as the HTTP answers Jupyter clients expect."""
    try:
        yield
    except UnknownKernelError as exc:
        raise web.HTTPError(404, str(exc)) from exc
    except ForbiddenError as exc:
        log.warning("refused: %s", exc)
        raise web.HTTPError(403, str(exc)) from exc
    except ConfigError as exc:
        raise web.HTTPError(400, str(exc)) from exc
    except OverloadedError as exc:  # logged where it was refused
        raise web.HTTPError(503, str(exc)) from exc
    except PlacementError as exc:
        log.warning("no room for a kernel: %s", exc)
        raise web.HTTPError(503, str(exc)) from exc
    except HostUnreachableError as exc:
        # A host too slow or gone for now: the gateway's trouble, worth asking again.
        log.warning("kernel request failed: %s", exc)
        raise web.HTTPError(503, str(exc)) from exc
    except StateWriteError as exc:
        # Logged by the gateway. A full disk is 507 Insufficient Storage; EIO and the
        # like are the gateway's trouble, not the request's: 503.
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        raise web.HTTPError(507 if full else 503, str(exc)) from exc
    except NbosError as exc:
        log.exception("kernel request failed")
        raise web.HTTPError(500, str(exc)) from exc


class ApiRoot(ApiHandler):
    def get(self) -> None:
        self.reply({"version": __version__, "nbos": __version__})


class KernelSpecs(ApiHandler):
    def get(self) -> None:
        self.reply(specs_model(self.kernels.max_gpus()))


class KernelSpec(ApiHandler):
    def get(self, name: str) -> None:
        gpus = spec_gpus(name, self.kernels.max_gpus())
        if gpus is None:
            raise web.HTTPError(404, f"no kernelspec {name!r}")
        self.reply(spec_model(name, gpus))


class Kernels(ApiHandler):
    def get(self) -> None:
        self.reply([api.model() for api in self.kernels.visible(self.user)])

    async def post(self) -> None:
        request: _StartRequest = self.body_as(_StartRequest)
        gpus = spec_gpus(request.name, self.kernels.max_gpus())
        if gpus is None:
            raise web.HTTPError(404, f"no kernelspec {request.name!r}")
        with api_errors():
            api = await self.kernels.start(request.name, gpus, request.env, self.user)
        self.set_header("Location", f"/api/kernels/{api.kernel_id}")
        self.reply(api.model(), 201)


class KernelOne(ApiHandler):
    def get(self, kernel_id: str) -> None:
        self.reply(self.kernel(kernel_id).model())

    async def delete(self, kernel_id: str) -> None:
        api = self.kernel(kernel_id)
        with api_errors():
            await self.kernels.shutdown(api)
        self.set_status(204)
        self.finish()


class KernelInterrupt(ApiHandler):
    async def post(self, kernel_id: str) -> None:
        self.body_as(_Empty)
        api = self.kernel(kernel_id)
        with api_errors():
            await self.kernels.interrupt(api)
        self.set_status(204)
        self.finish()


class KernelRestart(ApiHandler):
    async def post(self, kernel_id: str) -> None:
        self.body_as(_Empty)
        api = self.kernel(kernel_id)
        with api_errors():
            await self.kernels.restart(api)
        self.reply(api.model())
