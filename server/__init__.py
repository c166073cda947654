"""sgl-kvc's additions to SGLang's HTTP API."""

from sgl_kvc.server.routes import mount, router

__all__ = ["mount", "router"]
