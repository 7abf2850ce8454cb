"""A throwaway certificate authority, for `specd up --tls` and the tests.

    ca = LocalCA.create("specdec local CA")
    bundle = ca.write_role(directory, "target", hosts=("target", "localhost", "127.0.0.1"))
    bundle.cert, bundle.key, bundle.ca        # PEM file paths

Each certificate names its role in the common name and as the first DNS
subject alternative name (the services check the caller's name, the
orchestrator checks the services' names), and is good for both server and
client authentication. Keys are ECDSA P-256; certificates last `days`.
Production certificates come from your own PKI (cert-manager in Kubernetes:
deploy/components/mtls), not from here.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class CertFiles:
    """PEM files of one identity: its certificate, its key, and the CA's certificate."""

    cert: str
    key: str
    ca: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for host in hosts:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            entries.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(entries)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, private: bool = False) -> str:
    # A key is created 0600 from the start, never readable by others in between
    # (truncated while still of the old mode, so nothing of the new key is exposed).
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    if private:
        os.fchmod(fd, 0o600)  # a file that was there keeps its mode through O_TRUNC, 0644 perhaps
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return str(path)


class LocalCA:
    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate):
        self.key = key
        self.cert = cert

    @classmethod
    def create(cls, common_name: str = "specdec local CA", days: int = 30) -> "LocalCA":
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder()
                .subject_name(_name(common_name)).issuer_name(_name(common_name))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(key, cert)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, common_name: str, hosts: Sequence[str] = (), days: int = 30) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) naming `common_name` (also the first
        DNS SAN) and `hosts`, for server and client authentication."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        names = list(dict.fromkeys([common_name, *hosts]))
        cert = (x509.CertificateBuilder()
                .subject_name(_name(common_name)).issuer_name(self.cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(_san(names), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self.key, hashes.SHA256()))
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)

    def write_ca(self, directory: str | os.PathLike) -> str:
        return _write(Path(directory) / "ca.crt", self.cert_pem)

    def write_role(self, directory: str | os.PathLike, common_name: str,
                   hosts: Sequence[str] = LOCAL_HOSTS) -> CertFiles:
        """Issue a certificate for `common_name` and write NAME.crt, NAME.key
        (mode 0600) and ca.crt into `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        cert, key = self.issue(common_name, hosts)
        return CertFiles(cert=_write(directory / f"{common_name}.crt", cert),
                         key=_write(directory / f"{common_name}.key", key, private=True),
                         ca=self.write_ca(directory))


ROLES = ("orchestrator", "draft", "target")


@dataclass(frozen=True)
class LocalTls:
    """A throwaway CA's certificates for the three roles, and the `specd
    serve` flags that put them to use (what `specd up --tls` runs)."""

    directory: str
    files: dict[str, CertFiles]

    @classmethod
    def create(cls, directory: str | os.PathLike) -> "LocalTls":
        ca = LocalCA.create()
        return cls(str(directory), {role: ca.write_role(directory, role) for role in ROLES})

    @property
    def ca(self) -> str:
        return self.files["orchestrator"].ca

    def flags(self, role: str) -> list[str]:
        """draft, target: serve mutual TLS to the orchestrator; orchestrator:
        TLS at its front doors and its certificate as the services' client."""
        own = self.files[role]
        serve = ["--tls-cert", own.cert, "--tls-key", own.key]
        if role != "orchestrator":
            return [*serve, "--tls-ca", own.ca]
        return [*serve, "--downstream-ca", own.ca, "--downstream-cert", own.cert, "--downstream-key", own.key]
