"""`pagoda gateway` under gunicorn: `pagoda serve`'s server (gthread workers, graceful SIGTERM, supervision)
with the gateway as the one API its app mounts.

A stream through the gateway holds a request thread until its last event, exactly as it does in the
generation server behind it, so the same worker shape fits; the request threads block on upstream sockets
while the GIL is free for the others.
"""

from __future__ import annotations

import logging
import os
import threading

from serving.gateway.config import GatewayConfig
from serving.gateway.routes import GatewayApi
from serving.gateway.rules import Rules
from serving.server import WORKER_BOOT_ERROR, GunicornServer

log = logging.getLogger("pagoda.gateway")


class GatewayServer(GunicornServer):
    def __init__(self, cfg: GatewayConfig, rules: Rules):
        self.rules = rules
        super().__init__(cfg)

    def load_config(self) -> None:
        super().load_config()
        self.cfg.set("proc_name", "pagoda-gateway")

    def load(self):
        return build_app(self.serve_cfg, self.rules, exit_if_unloadable=True)


def build_app(cfg: GatewayConfig, rules: Rules, exit_if_unloadable: bool = False):
    """The gateway's Flask app. `exit_if_unloadable`: a worker whose routing model cannot load exits with
    gunicorn's boot-error status (the master stops, the reason in the log) instead of routing by default
    forever."""
    from serving.app import create_app

    api = GatewayApi(cfg, rules)
    app = create_app(cfg, [api])

    def watch() -> None:
        while not api.loaded.wait(0.2):
            if api.error is not None:
                log.error("stopping: the routing model did not load (%s)", api.error)
                os._exit(WORKER_BOOT_ERROR)

    if exit_if_unloadable:
        threading.Thread(target=watch, name="pagoda-gateway-load-watch", daemon=True).start()
    return app
