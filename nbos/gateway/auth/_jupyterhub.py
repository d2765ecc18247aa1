"""JupyterHub as an identity provider: the gateway as a service of a Hub.

A Hub's single-user server started with ``--gateway-url`` sends the gateway its own
``JUPYTERHUB_API_TOKEN`` (``docs/users.md``). The gateway asks the Hub whose it is as
``jupyterhub.services.auth.HubAuth.user_for_token`` does: ``GET {api_url}/user`` with
``Authorization: token <the user's token>``, which a Hub answers, for any token of a
user, with that user's model (``name``, ``admin``, ``groups``, ...) and refuses (403) for a
token it does not know. A Hub admin is an nbos ``admin``.

A user's answer is kept ``cache_s`` seconds (HubAuth's ``cache_max_age``), so a busy
client does not cost a Hub request on each of its requests; a token revoked at the Hub
therefore works until then. Nothing else is kept: an unknown token is asked about again,
and a Hub that does not answer, answers 5xx or sends what is not a user model makes an
:class:`~nbos.core.errors.IdentityProviderError` (logged), never a user.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
import urllib.parse

import msgspec
from tornado import httpclient, httputil, iostream
from tornado.simple_httpclient import HTTPStreamClosedError, SimpleAsyncHTTPClient

from nbos.core.errors import ConfigError, IdentityProviderError
from nbos.core.identity import User
from nbos.gateway.auth._users_file import RESERVED_NAME

log = logging.getLogger(__name__)

#: A user model is a few hundred bytes; a longer answer is no Hub's.
MAX_ANSWER_BYTES = 64 * 1024
#: How long a Hub has to answer, from the connection's start (by default).
TIMEOUT_S = 10.0
#: The most users kept at once (each a few hundred bytes).
MAX_CACHED = 10_000
#: What a Hub answers for a token it does not know (403; 401 and 404 from a proxy
#: or an older Hub in front of it).
_UNKNOWN = frozenset({401, 403, 404})


class _HubModel(msgspec.Struct, frozen=True):
    """The fields of a Hub's ``GET /user`` answer that nbos reads (it has more)."""

    name: str
    kind: str = "user"
    admin: bool = False


def _is_api_url(url: str) -> bool:
    try:
        parsed = urllib.parse.urlsplit(url)
        parsed.port  # noqa: B018 (raises for a port out of range or not a number)
    except ValueError:
        return False
    return (
        parsed.scheme in ("http", "https")
        and bool(parsed.hostname)
        and not (parsed.query or parsed.fragment)
    )


class HubUsers:
    """The users of the JupyterHub whose REST API is ``api_url`` (``JUPYTERHUB_API_URL``,
    e.g. ``http://127.0.0.1:8081/hub/api``), an
    :class:`~nbos.core.identity.IdentityProvider`; each has ``default_quota``."""

    def __init__(
        self,
        api_url: str,
        cache_s: float = 60.0,
        default_quota: int = 0,
        *,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        if not _is_api_url(api_url):
            expected = "an http:// or https:// URL without ? or #"
            raise ConfigError("auth.jupyterhub_api_url", api_url, expected)
        if not (math.isfinite(cache_s) and cache_s >= 0):
            raise ConfigError("auth.jupyterhub_cache_s", cache_s, "seconds >= 0")
        self.user_url = api_url.rstrip("/") + "/user"
        self.cache_s = cache_s
        self.default_quota = default_quota
        self.timeout_s = timeout_s
        # sha256 of a token -> (when its answer expires, time.monotonic(); the user)
        self._cache: dict[str, tuple[float, User]] = {}

    async def authenticate(self, token: str) -> User | None:
        if not (token.isascii() and token.isprintable()):
            return None  # no Hub token (a ?token= may decode to anything): never sent on
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now:
            return cached[1]
        self._cache.pop(key, None)
        user = await self._ask(token)
        if user is not None and self.cache_s > 0:
            self._keep(key, now + self.cache_s, user)
        return user

    async def _ask(self, token: str) -> User | None:
        """The Hub's answer for ``token``: a user, or ``None`` for a token it does not know."""
        response = await self._fetch(token)
        if response.code in _UNKNOWN:
            return None
        if response.code != 200:
            raise self._error(f"answered {response.code} {response.reason}")
        try:
            model = msgspec.json.decode(response.body, type=_HubModel)
        except msgspec.DecodeError as exc:
            raise self._error(f"answered what is not a user model ({exc})") from None
        return self._user(model)

    async def _fetch(self, token: str) -> httpclient.HTTPResponse:
        # Its own client: tornado's shared one cannot bound an answer's size, and the
        # simple client opens a connection per request anyway.
        client = SimpleAsyncHTTPClient(
            force_instance=True, max_body_size=MAX_ANSWER_BYTES, max_buffer_size=MAX_ANSWER_BYTES
        )
        try:
            return await client.fetch(
                self.user_url,
                headers={"Authorization": f"token {token}", "Accept": "application/json"},
                request_timeout=self.timeout_s,
                connect_timeout=self.timeout_s,
                follow_redirects=False,
                raise_error=False,
            )
        except (HTTPStreamClosedError, iostream.StreamClosedError):
            # Tornado closes the connection of an answer over its max_body_size too.
            what = (
                f"closed the connection before a whole answer of at most {MAX_ANSWER_BYTES} bytes"
            )
            raise self._error(what) from None
        except (OSError, httpclient.HTTPClientError, httputil.HTTPInputError) as exc:
            raise self._error(f"did not answer ({type(exc).__name__}: {exc})") from None
        finally:
            client.close()

    def _user(self, model: _HubModel) -> User | None:
        if model.kind != "user":
            log.warning(
                "JupyterHub token of a %.40r (%.80r), not a user: refused", model.kind, model.name
            )
            return None
        if model.name == RESERVED_NAME:
            log.warning("JupyterHub user %r: a name nbos reserves, refused", model.name)
            return None
        fields = {"name": model.name, "role": "admin" if model.admin else "user"}
        try:
            return msgspec.convert({**fields, "quota": self.default_quota}, User)
        except msgspec.ValidationError as exc:
            log.warning(
                "JupyterHub user %.80r: not a name nbos takes (%s), refused", model.name, exc
            )
            return None

    def _keep(self, key: str, expires: float, user: User) -> None:
        if len(self._cache) >= MAX_CACHED:
            now = time.monotonic()
            self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
            while len(self._cache) >= MAX_CACHED:
                del self._cache[next(iter(self._cache))]
        self._cache[key] = (expires, user)

    def _error(self, what: str) -> IdentityProviderError:
        log.warning("JupyterHub at %s %s", self.user_url, what)
        return IdentityProviderError(f"JupyterHub at {self.user_url} {what}")
