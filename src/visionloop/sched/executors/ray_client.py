"""The Ray executor's line to a cluster: the dashboard's job SDK (`JobSubmissionClient`) and
its state API (`list_nodes`), spoken over HTTP only, with a timeout on every request and
Ray's errors turned into ExecutorError (see `ray.py`'s docstring: the control plane never
joins the cluster). `ray` is imported lazily, on first use."""

from __future__ import annotations

import inspect
import os
import threading
from typing import Any

from visionloop.core.errors import ExecutorError, ExecutorUnavailableError
from visionloop.sched.executors.ray_nodes import NODE_ID_LABEL

DEFAULT_REQUEST_TIMEOUT_S = 30.0


class RayJobs:
    """The cluster's job API at dashboard URL `address`, as the executor uses it."""

    def __init__(self, address: str, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> None:
        self.address = address.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self._lock = threading.Lock()
        self._client_obj: Any = None
        self._label_selectors: bool | None = None

    def client(self) -> Any:
        """The JobSubmissionClient, made on first use (its constructor already calls the
        dashboard), with a timeout on every request: Ray's SDK sets none, and a hung
        dashboard must not hang the control plane's scheduling cycle."""
        with self._lock:
            if self._client_obj is not None:
                return self._client_obj
            for var in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
                value = os.environ.get(var)
                if value and value.rstrip("/") != self.address:
                    raise ExecutorError(
                        f"{var}={value} is set in the control plane's environment; Ray's SDK would use it "
                        f"instead of the address given to RayExecutor ({self.address}). Unset {var}, or "
                        "set it to the same dashboard URL."
                    )
            try:
                from ray.job_submission import JobSubmissionClient
            except ImportError as e:
                raise ExecutorError(
                    "the Ray executor needs Ray's job SDK: `pip install 'visionloop[ray]'` "
                    f"(ray[default]) on the control plane's machine ({e})."
                ) from e
            timeout = self.request_timeout_s

            class _Client(JobSubmissionClient):
                def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> Any:
                    kwargs.setdefault("timeout", timeout)
                    return super()._do_request(method, endpoint, **kwargs)

            try:
                client = _Client(self.address)
            except (OSError, RuntimeError, ValueError) as e:
                raise self.unreachable(e) from e
            params = inspect.signature(JobSubmissionClient.submit_job).parameters
            self._label_selectors = "entrypoint_label_selector" in params
            self._client_obj = client
            return client

    def unreachable(self, e: BaseException) -> ExecutorError:
        return ExecutorUnavailableError(
            f"cannot reach the Ray dashboard at {self.address}: {reason(e)}. Is the cluster running? "
            "Check with `ray status` on the head node; the address is the dashboard URL "
            "(http://HEAD:8265), and the head must be started with --dashboard-host reachable from here."
        )

    def call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """One SDK call; None when Ray answers 404 (no such job), ExecutorError otherwise."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            if "status code 404" in str(e):
                return None
            raise ExecutorError(f"Ray refused to {what}: {reason(e)}") from e
        except (OSError, ValueError) as e:
            raise self.unreachable(e) from e

    def info(self, sid: str) -> Any:
        """The job's JobDetails, or None if Ray has no such submission."""
        return self.call(f"describe job {sid}", self.client().get_job_info, sid)

    def info_quietly(self, sid: str) -> Any:
        """As `info`, and None where Ray cannot be asked either."""
        try:
            return self.info(sid)
        except ExecutorError:
            return None

    def stop(self, sid: str) -> None:
        """Ray's stop_job (see `ray.py`'s docstring, Kill); a no-op on an unknown job."""
        self.call(f"stop job {sid}", self.client().stop_job, sid)

    def pin(self, node_id: str, ip: str | None) -> dict[str, Any]:
        """Scheduling kwargs that put an entrypoint on one node."""
        self.client()  # sets _label_selectors
        if self._label_selectors or not ip:
            return {"entrypoint_label_selector": {NODE_ID_LABEL: node_id}}
        # Older Ray: the node's IP resource. Nodes sharing an IP share a host (and its /proc).
        return {"entrypoint_resources": {f"node:{ip}": 0.001}}

    def list_nodes(self) -> list[Any]:
        """Every node the cluster knows (alive or not), from the state API."""
        try:
            from ray.util.state import list_nodes
            from ray.util.state.exception import RayStateApiException
        except ImportError as e:
            raise ExecutorError(f"the Ray executor needs `pip install 'visionloop[ray]'` ({e}).") from e
        try:
            return list(
                list_nodes(
                    address=self.address,
                    limit=10_000,
                    timeout=max(1, round(self.request_timeout_s)),
                    raise_on_missing_output=False,
                )
            )
        except (RayStateApiException, OSError, RuntimeError, ValueError) as e:
            raise self.unreachable(e) from e


def reason(e: BaseException | str) -> str:
    """The line of a Ray error that says what went wrong: Ray's SDK wraps server-side
    exceptions as "Request failed with status code 500: Traceback ...", reason last."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip().strip(".")]
    if not lines:
        return type(e).__name__ if isinstance(e, BaseException) else ""
    return lines[-1] if len(lines) > 1 and "Traceback" in lines[0] else lines[0]
