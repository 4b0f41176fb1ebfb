"""Graceful drain: what ``verispec serve`` does on SIGTERM (a Kubernetes pod being stopped).

    SIGTERM ──► readiness false, new requests 503 + Retry-After ──► running requests finish
            ──► (grace period over) the rest are cancelled cleanly ──► uvicorn stops ──► exit 0

``DrainingServer`` is uvicorn's server with that first SIGTERM handled here instead of by
uvicorn (which would close the listening socket at once, so new clients would see refused
connections instead of a 503 telling them to retry elsewhere). A second SIGTERM, or SIGINT,
stops at once as uvicorn does. The drained SIGTERM is not re-raised, so the process exits 0.
"""
from __future__ import annotations

import logging
import signal
import threading
import time

import uvicorn

log = logging.getLogger("verispec.serve")


class DrainingServer(uvicorn.Server):
    """``pipeline``: the app's ``RequestPipeline``; ``grace_s``: how long running requests may
    take after SIGTERM before they are cancelled."""

    def __init__(self, config: uvicorn.Config, pipeline, grace_s: float):
        super().__init__(config)
        self.pipeline, self.grace_s = pipeline, grace_s
        self.draining = False

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self.draining:
            self.draining = True
            self.pipeline.begin_drain()
            log.info("SIGTERM: draining (up to %.0f s for running requests)", self.grace_s)
            threading.Thread(target=self._drain, name="verispec-drain", daemon=True).start()
            return
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        deadline = time.monotonic() + self.grace_s
        while self.pipeline.busy and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.pipeline.scheduler is not None:
            self.pipeline.scheduler.stop(grace_s=0.0)      # cancel what is left (503 to its clients)
        self.should_exit = True
