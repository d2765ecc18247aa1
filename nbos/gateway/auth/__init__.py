"""Who may use the gateway: the identity providers, the gateway's own operator token, and
the token file through which local clients find it (``docs/users.md``)."""

from nbos.gateway.auth._authenticator import OPERATOR, Authenticator, acting_for
from nbos.gateway.auth._jupyterhub import HubUsers
from nbos.gateway.auth._token_file import (
    TOKEN_ENV,
    client_token,
    remove_token_file,
    token_path,
    write_token_file,
)
from nbos.gateway.auth._users_file import UsersFile, users_file_entry

__all__ = [
    "OPERATOR",
    "TOKEN_ENV",
    "Authenticator",
    "HubUsers",
    "UsersFile",
    "acting_for",
    "client_token",
    "remove_token_file",
    "token_path",
    "users_file_entry",
    "write_token_file",
]
