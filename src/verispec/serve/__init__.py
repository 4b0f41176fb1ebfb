"""The OpenAI-compatible server: ``create_app`` (HTTP, ``app``), ``Scheduler`` (continuous
batching, ``scheduler``), ``ServerMetrics`` (Prometheus, ``metrics``) and speculation policies
(``policy``). Needs the ``serve`` extras (fastapi, uvicorn, prometheus-client).
``python -m verispec.serve`` runs ``verispec serve``."""
from .app import ServeConfig, create_app
from .metrics import ServerMetrics
from .policy import SpecPolicy, StaticPolicy, TablePolicy, parse_policy
from .scheduler import Scheduler

__all__ = ["ServeConfig", "create_app", "ServerMetrics", "Scheduler", "SpecPolicy", "StaticPolicy",
           "TablePolicy", "parse_policy"]
