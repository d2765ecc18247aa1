"""Who may use the gateway: the identity providers, the gateway's own operator token, and
the token file through which local clients find it (``docs/users.md``)."""

from nbos.gateway.auth._authenticator import OPERATOR, Authenticator
from nbos.gateway.auth._jupyterhub import HubUsers
from nbos.gateway.auth._token_file import client_token, token_path
from nbos.gateway.auth._users_file import UsersFile

__all__ = ["OPERATOR", "Authenticator", "HubUsers", "UsersFile", "client_token", "token_path"]
