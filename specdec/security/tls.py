"""TLS settings of the three roles, and the gRPC credentials made from them.

    draft, target      serve mutual TLS: --tls-cert/--tls-key, and --tls-ca to
                       verify the caller's certificate (required with TLS);
                       only callers named in --allowed-callers are served.
    orchestrator       its front doors (gRPC, HTTP) serve TLS with
                       --tls-cert/--tls-key (--tls-ca: clients need a
                       certificate too); it dials the services with
                       --downstream-ca/--downstream-cert/--downstream-key.

Plaintext stays the default on loopback (`specd up`, tests); anywhere else it
must be asked for with --insecure, so a forgotten certificate is a start-up
error, not an open port.
"""
from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass
from typing import Callable, TypeVar

from specdec.config import opt

log = logging.getLogger(__name__)
T = TypeVar("T")

LOOPBACK_NAMES = ("localhost", "ip6-localhost")


class TlsSettingsError(ValueError):
    """Settings that cannot work: shown to the user as one line."""


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_pem(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TlsSettingsError(f"cannot read {what} {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise TlsSettingsError(f"{what} {path} is not PEM")
    return data


def refuse_plaintext(host: str, what: str, insecure: bool, remedy: str = "--tls-cert/--tls-key") -> None:
    """Plaintext on a non-loopback address only with --insecure."""
    if not insecure and not is_loopback(host):
        raise TlsSettingsError(f"{what} on {host} would be plaintext: give certificates ({remedy}, see "
                               "docs/security.md) or pass --insecure to accept plaintext")


@dataclass
class TlsConfig:
    """How a role's server ports are secured (flags / SPECD_* environment)."""

    tls_cert: str = opt("", "PEM certificate (chain) this server presents; with --tls-key its ports speak TLS")
    tls_key: str = opt("", "PEM private key of --tls-cert")
    tls_ca: str = opt("", "PEM CA bundle: callers must present a certificate signed by it (mutual TLS); "
                          "draft and target need it whenever they serve TLS")
    allowed_callers: str = opt("orchestrator", "draft, target: comma-separated names (certificate CN or DNS SAN) "
                                               "a caller's certificate must carry to be served")
    insecure: bool = opt(False, "allow plaintext on an address other than loopback (binding, and dialing "
                                "the services)")

    @property
    def enabled(self) -> bool:
        return bool(self.tls_cert)

    @property
    def mutual(self) -> bool:
        return self.enabled and bool(self.tls_ca)

    def callers(self) -> frozenset[str]:
        return frozenset(name.strip() for name in self.allowed_callers.split(",") if name.strip())

    def validate(self, host: str, role: str, require_client_certs: bool) -> "TlsConfig":
        """Raise TlsSettingsError for settings that cannot work, before anything binds."""
        if bool(self.tls_cert) != bool(self.tls_key):
            raise TlsSettingsError("--tls-cert and --tls-key go together")
        if self.tls_ca and not self.tls_cert:
            raise TlsSettingsError("--tls-ca needs --tls-cert/--tls-key (client certificates are checked over TLS)")
        if self.enabled:
            for path, what in ((self.tls_cert, "--tls-cert"), (self.tls_key, "--tls-key"),
                               *([(self.tls_ca, "--tls-ca")] if self.tls_ca else [])):
                read_pem(path, what)
            if require_client_certs and not self.tls_ca:
                raise TlsSettingsError(f"the {role} serves only the orchestrator: with --tls-cert it needs --tls-ca "
                                       "to verify its callers' certificates")
            if require_client_certs and not self.callers():
                raise TlsSettingsError("--allowed-callers names no one")
        else:
            refuse_plaintext(host, f"the {role}'s port", self.insecure)
        return self

    def server_credentials(self):
        """grpc server credentials, or None for plaintext. The files are
        re-read when they change (`ReloadingCertificates`)."""
        if not self.enabled:
            return None
        import grpc

        files = ReloadingCertificates(self.tls_cert, self.tls_key, self.tls_ca)
        return grpc.dynamic_ssl_server_credentials(files.configuration(), files.fetch_if_changed,
                                                   require_client_authentication=bool(self.tls_ca))


class ReloadingCertificates:
    """A server's certificate, key and CA files, re-read when they change, so a
    renewed certificate (cert-manager rewrites the Secret, the kubelet swaps
    the mounted files at once) is served without a restart. gRPC asks
    `fetch_if_changed` before each new TLS handshake: one stat per file."""

    def __init__(self, cert: str, key: str, ca: str = ""):
        self.paths = tuple(p for p in (cert, key, ca) if p)
        self.cert, self.key, self.ca = cert, key, ca
        self._signature = self._stat()
        self._failed: tuple | None = None  # the files as they were when a load last failed

    def _stat(self) -> tuple:
        return tuple((st.st_mtime_ns, st.st_ino, st.st_size) for st in map(os.stat, self.paths))

    def configuration(self):
        import grpc

        pair = (read_pem(self.key, "--tls-key"), read_pem(self.cert, "--tls-cert"))
        ca = read_pem(self.ca, "--tls-ca") if self.ca else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def fetch_if_changed(self):
        """A new gRPC configuration when the files changed, else None."""
        return self.reload_if_changed(self.configuration)

    def reload_if_changed(self, load: Callable[[], T]) -> T | None:
        """load()'s result when the files changed since the last load, else
        None: also when they cannot be loaded (then the current certificate
        is kept, and the load is tried again, and a failure logged, once the
        files change again: not at every handshake)."""
        signature = None
        try:
            signature = self._stat()
            if signature == self._signature or signature == self._failed:
                return None
            loaded = load()
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError; TlsSettingsError a ValueError
            self._failed = signature
            log.warning("TLS files changed but cannot be loaded; still serving the previous certificate: %s", exc)
            return None
        self._signature = signature
        log.info("TLS files changed: serving the new certificate from %s", self.cert)
        return loaded


class ReloadingServerContext:
    """A server's Python SSL context from its certificate files, rebuilt when
    they change, for the ports Python's ssl serves (the lanes, the HTTP
    port): each handshake switches to the newest complete context as it
    starts, so a renewed certificate or CA is served from the next connection
    on, and files that cannot be loaded (a key not yet written, a certificate
    that does not match it) leave the previous context serving. Changing a
    live context in place cannot promise that: OpenSSL swaps a certificate
    before it reads the key, and a failed key load left the port serving a
    certificate without its key, refusing every handshake. With `ca`, the
    caller must present a certificate it signed."""

    def __init__(self, cert: str, key: str, ca: str = ""):
        self.files = ReloadingCertificates(cert, key, ca)
        self._context = self._load()

    def _load(self):
        import ssl

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.files.cert, self.files.key)
        if self.files.ca:
            context.load_verify_locations(self.files.ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def context(self):
        """The context for the next handshake: the newest that loaded."""
        fresh = self.files.reload_if_changed(self._load)
        if fresh is not None:
            self._context = fresh
        return self._context

    def listening_context(self, listening=None):
        """`listening` (a new context when None), made to switch each
        handshake to `context()` as it starts: the server-name callback runs
        for every handshake, a name sent or not."""
        listening = self._load() if listening is None else listening

        def newest(connection, _server_name, _context) -> None:
            connection.context = self.context()

        listening.sni_callback = newest
        return listening


@dataclass(frozen=True)
class ClientTls:
    """How a client dials over TLS: the CA to verify the server against, and
    (for mutual TLS) its own certificate and key."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert)

    def validate(self, what: str) -> "ClientTls":
        if bool(self.cert) != bool(self.key):
            raise TlsSettingsError(f"{what}: a client certificate and its key go together")
        if self.cert and not self.ca:
            raise TlsSettingsError(f"{what}: a client certificate needs the CA to verify the server with")
        for path in (self.ca, self.cert, self.key):
            if path:
                read_pem(path, what)
        return self

    def ssl_context(self):
        """The same as an ssl context, for connections that are not gRPC's (a service's lane)."""
        import ssl

        context = ssl.create_default_context(cafile=self.ca or None)
        if self.cert:
            context.load_cert_chain(self.cert, self.key)
        return context

    def channel_credentials(self):
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, "the CA certificate") if self.ca else None,
            private_key=read_pem(self.key, "the client key") if self.key else None,
            certificate_chain=read_pem(self.cert, "the client certificate") if self.cert else None)
