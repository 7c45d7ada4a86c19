"""The production server: gunicorn with gthread workers around the Flask app.

Why gunicorn/gthread (see docs/serving.md): the model is one big object per process, and the batcher
needs many request threads blocked on it at once. A gthread worker is exactly that, one process, N
request threads, with the model worker thread beside them; gunicorn's master adds what a decision
service needs around it: graceful SIGTERM (stop accepting, let in-flight requests finish, exit), worker
restarts, `--workers` to scale across cores. The app loads in each worker after fork, so the master never
imports torch. A worker where any API's model fails to load exits with gunicorn's boot-error status, which
stops the whole server with the reason in the log instead of serving 503s forever.
"""

from __future__ import annotations

import logging
import math
import os
import threading

from gunicorn.app.base import BaseApplication

from serving.config import ServeConfig

WORKER_BOOT_ERROR = 3  # gunicorn.arbiter.Arbiter.WORKER_BOOT_ERROR: the master halts on it


class GunicornServer(BaseApplication):
    def __init__(self, cfg: ServeConfig):
        self.serve_cfg = cfg
        super().__init__(prog="pagoda serve")

    def load_config(self) -> None:
        cfg = self.serve_cfg
        settings = {
            "bind": [f"{cfg.host}:{cfg.port}"],
            "workers": cfg.workers,
            "worker_class": "gthread",
            "threads": cfg.threads,
            "graceful_timeout": math.ceil(cfg.graceful_timeout_s),
            # The heartbeat runs on the worker's main loop, never blocked by the model thread; a long
            # timeout only matters while a worker imports torch and loads the model.
            "timeout": max(120, int(cfg.request_timeout_s * 2)),
            "keepalive": 5,
            "accesslog": None,  # the app writes its own JSON access line
            "errorlog": "-",
            "loglevel": "warning",
            "proc_name": "pagoda-serve",
            "when_ready": _announce,
        }
        for key, value in settings.items():
            self.cfg.set(key, value)

    def load(self):
        from serving.app import create_app

        app = create_app(self.serve_cfg)
        apis = app.extensions["pagoda.apis"]

        def exit_on_failure() -> None:
            while not all(api.loaded.wait(0.2) for api in apis):
                for api in apis:
                    if api.error is not None:
                        logging.getLogger("pagoda.serve").error("stopping: the %s model did not load (%s)",
                                                                api.name, api.error)
                        os._exit(WORKER_BOOT_ERROR)

        threading.Thread(target=exit_on_failure, name="pagoda-load-watch", daemon=True).start()
        return app


def _announce(server) -> None:
    for listener in server.LISTENERS:
        server.log.warning("pagoda serving on %s (pid %d)", listener, os.getpid())


def serve(cfg: ServeConfig) -> None:
    GunicornServer(cfg).run()
