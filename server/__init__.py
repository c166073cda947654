"""sgl-kvc's additions to SGLang's HTTP API (installed as `sgl_kvc.server`)."""

from sgl_kvc.server.routes import mount, router

__all__ = ["mount", "router"]
