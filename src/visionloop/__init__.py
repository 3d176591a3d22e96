"""visionloop: labelled images in; a trained, tracked, resumable model out."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("visionloop")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
