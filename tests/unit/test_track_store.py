"""Store helpers that need no database: URIs, the UI command, which errors are worth retrying."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, INVALID_PARAMETER_VALUE, RESOURCE_DOES_NOT_EXIST

from visionloop.core.errors import TrackingError
from visionloop.track.store import (
    is_permanent_error,
    is_server_uri,
    quote_filter_value,
    redact_uri,
    sqlite_path,
    ui_command,
)


def test_ui_command_for_a_local_store_is_a_shell_command(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'my home' / 'mlflow.db'}"
    cmd = ui_command(uri)
    assert shlex.split(cmd) == ["mlflow", "ui", "--backend-store-uri", uri, "--port", "5000"]


def test_ui_command_for_a_server_is_its_address_without_the_password() -> None:
    assert ui_command("http://ml.internal:5000") == "http://ml.internal:5000"
    assert ui_command("https://bob:s3cret@ml.internal") == "https://bob:***@ml.internal"
    assert is_server_uri("https://ml.internal") and not is_server_uri("postgresql://h/db")


def test_redact_uri_hides_only_the_password() -> None:
    assert redact_uri("postgresql://vl:pw@db:5432/mlflow") == "postgresql://vl:***@db:5432/mlflow"
    assert redact_uri("sqlite:////x/mlflow.db") == "sqlite:////x/mlflow.db"


def test_sqlite_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert sqlite_path("sqlite:////abs/mlflow.db") == Path("/abs/mlflow.db")
    assert sqlite_path("sqlite:///rel.db") == tmp_path / "rel.db"
    assert sqlite_path("sqlite:///:memory:") is None
    assert sqlite_path("postgresql://h/db") is None


def test_client_errors_are_permanent_server_and_connection_errors_are_not() -> None:
    assert is_permanent_error(MlflowException("bad value", INVALID_PARAMETER_VALUE))
    assert is_permanent_error(MlflowException("run gone", RESOURCE_DOES_NOT_EXIST))
    assert not is_permanent_error(MlflowException("database is locked", INTERNAL_ERROR))
    assert not is_permanent_error(ConnectionError("refused"))


def test_filter_values_are_quoted_or_refused() -> None:
    assert quote_filter_value("/runs/a") == "'/runs/a'"
    assert quote_filter_value("/runs/it's") == '"/runs/it\'s"'
    with pytest.raises(TrackingError, match="run id instead"):
        quote_filter_value("""both ' and " """)
