"""The Ray Serve application: `serve run deployments.app`.

`app` is an application builder (Serve calls it with the `args` of `serve run ... k=v` or
of a config file's application), so importing this package starts nothing.
"""

from deployments.config import AppConfig, load_config


def app(args: dict):
    from deployments.application import build_app

    return build_app(args)


__all__ = ["app", "AppConfig", "load_config"]
