"""The inference server over HTTPS (uvicorn's --ssl-certfile/--ssl-keyfile) with a certificate
the test makes: a client that verifies against it gets answers, one that does not trust it,
or speaks plain HTTP, gets none."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import numpy as np
import pytest

from _servekit import NAME, ServeKit, infer_body, ort_logits, serve_kit
from visionloop.core.errors import ConfigError
from visionloop.serve.config import ServeConfig
from visionloop.serve.keys import KeyRing, KeyStore
from visionloop.serve.server import BackgroundServer

__all__ = ["serve_kit"]


def _certificate(tmp: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, valid for a day (cryptography: a dev dependency)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256())
    )
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key.chmod(0o600)
    return cert, key


def test_https_with_a_key(serve_kit: ServeKit, tmp_path: Path) -> None:
    cert, private = _certificate(tmp_path)
    _, key = KeyStore(tmp_path / "home").create("tls-client", [NAME])
    ring = KeyRing.for_home(tmp_path / "home")
    cfg = ServeConfig(model=NAME, port=0)
    with BackgroundServer(cfg, serve_kit.source(), tmp_path / "p.jsonl", keys=ring, tls=(cert, private)) as s:
        assert s.url.startswith("https://127.0.0.1:")
        trusted = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(verify=trusted, headers={"Authorization": f"Bearer {key}"}) as c:
            assert c.get(f"{s.url}/v2/health/ready").json() == {"ready": True}
            x = serve_kit.batch(2)
            r = c.post(f"{s.url}/v2/models/{NAME}/infer", json=infer_body(x))
            assert r.status_code == 200, r.text
            got = np.array(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(2, -1)
            np.testing.assert_allclose(got, ort_logits(serve_kit.v1, x), rtol=1e-5, atol=1e-5)
        # The key still counts over TLS.
        with httpx.Client(verify=trusted) as c:
            assert c.get(f"{s.url}/v2/models/{NAME}").status_code == 401
        # A client that does not trust the certificate refuses the connection...
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{s.url}/v2/health/live")
        # ...and plain HTTP gets no answer from a TLS port.
        with pytest.raises(httpx.HTTPError):
            httpx.get(s.url.replace("https://", "http://") + "/v2/health/live")


def test_missing_tls_files_are_refused(serve_kit: ServeKit, tmp_path: Path) -> None:
    cfg = ServeConfig(model=NAME, port=0)
    with pytest.raises(ConfigError, match="--ssl-certfile"):
        BackgroundServer(cfg, serve_kit.source(), None, tls=(tmp_path / "no.pem", tmp_path / "no.key"))
