"""A small client for Label Studio's REST API: create a project, import tasks, export them.

Not `label-studio-sdk`: its 2.x release pulls in about twenty packages visionloop has no use
for (nltk, opencv, black, Faker, a code generator) and pins numpy below the version the rest of
visionloop runs on; the four endpoints used here are documented and stable. The tests run it
against a real Label Studio server.

Tokens: a personal access token (a JWT, Label Studio's default since 1.14) is exchanged for a
short-lived access token at `/api/token/refresh/`; a legacy token (40 hex digits, accepted
when the server runs with `--enable-legacy-api-token`) is sent as `Token ...`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx

from visionloop.label.studio import MAX_EXPORT_BYTES, LabelStudioError

IMPORT_BATCH = 50  # tasks per import request: each may carry an inline image


def _is_jwt(token: str) -> bool:
    return token.count(".") == 2 and not token.startswith("Token ")


class LabelStudio:
    def __init__(self, url: str, token: str, *, timeout: float = 60.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise LabelStudioError(f"--to {url!r} is not an http(s) URL, e.g. http://localhost:8080")
        if not token:
            raise LabelStudioError(
                "no Label Studio token: set LABEL_STUDIO_API_KEY (Account & Settings → Personal "
                "Access Token, or a legacy token)"
            )
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout, follow_redirects=False)
        self._auth = self._authorization(token)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> LabelStudio:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _authorization(self, token: str) -> str:
        if not _is_jwt(token):
            return f"Token {token.removeprefix('Token ').strip()}"
        answer = self._send("POST", "/api/token/refresh/", json={"refresh": token}, auth=None)
        access = answer.get("access") if isinstance(answer, dict) else None
        if not isinstance(access, str):
            raise LabelStudioError(f"{self.url} gave no access token for the personal access token")
        return f"Bearer {access}"

    def _send(self, method: str, path: str, *, auth: str | None = "", **kw: Any) -> Any:
        headers = {} if auth is None else {"Authorization": auth or self._auth}
        try:
            with self._http.stream(method, path, headers=headers, **kw) as r:
                body = bytearray()
                for chunk in r.iter_bytes():
                    body += chunk
                    if len(body) > MAX_EXPORT_BYTES:
                        raise LabelStudioError(
                            f"{self.url}{path} answered more than {MAX_EXPORT_BYTES // 2**20} MiB; "
                            "export the project in parts"
                        )
                status = r.status_code
        except httpx.HTTPError as e:
            raise LabelStudioError(f"cannot reach Label Studio at {self.url}: {e}") from e
        if status in (401, 403):
            raise LabelStudioError(
                f"Label Studio at {self.url} refused the token ({status}): check LABEL_STUDIO_API_KEY; "
                "a legacy token also needs the server's --enable-legacy-api-token"
            )
        if status >= 400:
            raise LabelStudioError(
                f"Label Studio answered {status} to {method} {path}: {bytes(body[:500])!r}"
            )
        if not body:
            return None
        try:
            return json.loads(body)
        except ValueError as e:
            raise LabelStudioError(f"Label Studio's answer to {method} {path} is not JSON: {e}") from e

    def create_project(self, title: str, config: str, description: str = "") -> int:
        if len(title) < 3:
            raise LabelStudioError(f"a project title needs 3 characters or more, not {title!r}")
        doc = self._send(
            "POST",
            "/api/projects/",
            json={"title": title, "label_config": config, "description": description},
        )
        if not isinstance(doc, dict) or not isinstance(doc.get("id"), int):
            raise LabelStudioError(f"Label Studio made no project: {doc!r:.300}")
        return int(doc["id"])

    def project_config(self, project: int) -> str:
        doc = self._send("GET", f"/api/projects/{int(project)}/")
        config = doc.get("label_config") if isinstance(doc, dict) else None
        if not isinstance(config, str):
            raise LabelStudioError(f"project {project} has no labelling config")
        return config

    def import_tasks(self, project: int, tasks: Sequence[dict[str, Any]]) -> int:
        """Import in batches; the number of tasks Label Studio says it made."""
        made = 0
        for start in range(0, len(tasks), IMPORT_BATCH):
            batch = list(tasks[start : start + IMPORT_BATCH])
            doc = self._send("POST", f"/api/projects/{int(project)}/import", json=batch)
            made += int(doc.get("task_count", 0)) if isinstance(doc, dict) else 0
        return made

    def users(self) -> dict[int, str]:
        """Each user's id and email (an export names annotators by id)."""
        doc = self._send("GET", "/api/users/")
        rows = doc.get("results", doc) if isinstance(doc, dict) else doc
        if not isinstance(rows, list):
            return {}
        return {
            int(u["id"]): str(u["email"])
            for u in rows
            if isinstance(u, dict) and isinstance(u.get("id"), int) and u.get("email")
        }

    def export(self, project: int) -> Any:
        """Every task of the project with its annotations and predictions (Export → JSON)."""
        return self._send(
            "GET",
            f"/api/projects/{int(project)}/export",
            params={"exportType": "JSON", "download_all_tasks": "true"},
        )
