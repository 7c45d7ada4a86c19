"""`pagoda gateway` under gunicorn: `pagoda serve`'s server (gthread workers, graceful SIGTERM, supervision)
with the gateway as the one API its app mounts.

A stream through the gateway holds a request thread until its last event, exactly as it does in the
generation server behind it, so the same worker shape fits; the request threads block on upstream sockets
while the GIL is free for the others.
"""

from __future__ import annotations

from serving.gateway.config import GatewayConfig
from serving.gateway.routes import GatewayApi
from serving.gateway.rules import Rules
from serving.server import GunicornServer


class GatewayServer(GunicornServer):
    def __init__(self, cfg: GatewayConfig, rules: Rules):
        self.rules = rules
        super().__init__(cfg)

    def load_config(self) -> None:
        super().load_config()
        self.cfg.set("proc_name", "pagoda-gateway")

    def load(self):
        from serving.app import create_app

        api = GatewayApi(self.serve_cfg, self.rules)
        app = create_app(self.serve_cfg, [api])
        self.watch_loading([api])
        return app
