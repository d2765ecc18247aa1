"""The Jupyter Kernel Gateway API of ``nbos gateway``: REST and WebSocket, over tornado.

What ``jupyter server --gateway-url`` (JupyterLab, JupyterHub's single-user
servers, VS Code's remote Jupyter server) speaks to a Kernel Gateway or an
Enterprise Gateway, served on ``[gateway] http_address`` (``docs/jupyter.md``):

* :mod:`._specs`: the ``nbos`` and ``nbos-gpu-N`` kernelspecs;
* :mod:`._kernels`: the API's kernels (restarts, activity, culling);
* :mod:`._channels`: a client's channels on a kernel front, over ZeroMQ;
* :mod:`._wsproto`: Jupyter messages in WebSocket frames;
* :mod:`._dashboard`: the dashboard page and its data (``/dashboard/``);
* :mod:`._handlers`, :mod:`._websocket`, :mod:`._server`: tornado.
"""

from nbos.gateway.http._server import DashboardSources, HttpApi, http_address, serve_http

__all__ = ["DashboardSources", "HttpApi", "http_address", "serve_http"]
