"""The inference server: Open Inference Protocol (KServe v2) over REST with Triton's binary
tensor extension, dynamic batching on ONNX Runtime, champion / canary / shadow routing by
registry alias, Prometheus metrics and a bounded prediction log.

Importing this package is cheap; the server's heavy parts load inside `serve.app`.
"""

from visionloop.serve.config import ServeConfig, load_serve_config

__all__ = ["ServeConfig", "load_serve_config"]
