"""Whose a request's token is: the operator's, or a user's of an identity provider."""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import Sequence
from pathlib import Path

from nbos.core.config import AuthSettings, Settings
from nbos.core.errors import ConfigError, ForbiddenError, UnauthorizedError
from nbos.core.identity import IdentityProvider, User, new_token
from nbos.core.private_files import private_dir, write_private
from nbos.gateway.auth._jupyterhub import HubUsers
from nbos.gateway.auth._users_file import RESERVED_NAME, UsersFile

log = logging.getLogger(__name__)

#: Whoever holds the gateway's operator token: an admin.
OPERATOR = User(name=RESERVED_NAME, role="admin")
_NEEDS_HUB = "auth.jupyterhub_api_url set (without a Hub it does nothing)"


class Authenticator:
    """The operator token first, then each provider in turn."""

    def __init__(self, operator_token: str, providers: Sequence[IdentityProvider] = ()) -> None:
        if not operator_token:
            raise ValueError("an operator token is required")
        self.operator_token = operator_token
        self.providers = tuple(providers)

    @classmethod
    def of(cls, settings: Settings, kept_in: Path | None = None) -> Authenticator:
        """The authenticator ``settings`` ask for. The operator token is ``[gateway]
        auth_token``; unset, the one in the file ``kept_in`` (a gateway's data dir: the
        same one after a restart), made there if there is none; without that file, a
        fresh one."""
        providers: list[IdentityProvider] = []
        auth = settings.auth
        if auth.users_file:
            providers.append(UsersFile(Path(auth.users_file), auth.default_quota))
        if auth.jupyterhub_api_url:
            hub = HubUsers(auth.jupyterhub_api_url, auth.jupyterhub_cache_s, auth.default_quota)
            providers.append(hub)
        elif auth.jupyterhub_cache_s != AuthSettings().jupyterhub_cache_s:
            raise ConfigError("auth.jupyterhub_cache_s", auth.jupyterhub_cache_s, _NEEDS_HUB)
        return cls(settings.gateway.auth_token or _kept_token(kept_in), providers)

    @property
    def has_users(self) -> bool:
        """Whether anyone but the operator may sign in."""
        return bool(self.providers)

    async def authenticate(self, token: str) -> User:
        """The user ``token`` belongs to.

        Raises :class:`~nbos.core.errors.UnauthorizedError` for none or an unknown one, and
        lets :class:`~nbos.core.errors.IdentityProviderError` through (a provider that
        cannot tell now).
        """
        if not token:
            raise UnauthorizedError("no credentials: a token is required")
        if hmac.compare_digest(token.encode(), self.operator_token.encode()):
            return OPERATOR
        for provider in self.providers:
            user = await provider.authenticate(token)
            if user is not None:
                return user
        raise UnauthorizedError("unknown token")


def _kept_token(path: Path | None) -> str:
    if path is None:
        return new_token()
    with contextlib.suppress(FileNotFoundError):
        if token := path.read_text().strip():
            return token
    token = new_token()
    private_dir(path.parent)
    write_private(path, token.encode() + b"\n")
    return token


def acting_for(user: User, name: str | None) -> str:
    """Whose a kernel ``user`` starts for ``name`` is (``None``: their own). Only an admin
    may start one for somebody else (Enterprise Gateway's impersonation): anyone else's
    request for it raises :class:`~nbos.core.errors.ForbiddenError`."""
    if name is None or name == user.name:
        return user.name
    if not user.is_admin:
        raise ForbiddenError(f"{user.name} may not start kernels for {name} (admins only)")
    return name
