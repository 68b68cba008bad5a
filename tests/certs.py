"""Test TLS certificates made with openssl: a CA and a server certificate for 127.0.0.1."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def make_certs(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(ca.crt, server.crt, server.key); skips the test when openssl is missing."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make test certificates")
    ca, ca_key = tmp_path / "ca.crt", tmp_path / "ca.key"
    cert, key, csr = tmp_path / "server.crt", tmp_path / "server.key", tmp_path / "server.csr"
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
        "-days", "1", "-subj", "/CN=tide-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    ext = tmp_path / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(cert), "-days", "1", "-extfile", str(ext))
    return ca, cert, key
