"""The orchestrator's security wiring: how it dials the services (mutual TLS,
or plaintext where allowed) and what its front doors require (TLS, API keys).
The checks themselves live in specdec.security and specdec.rpc.auth."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import grpc

from orchestrator.config import OrchestratorConfig
from orchestrator.downstream import channel_to
from orchestrator.replicas import split_address
from specdec.security.tls import ClientTls, refuse_plaintext


def server_name_of(service_address: str) -> str:
    """The name a service's certificate must carry: the host of its
    configured address (a Kubernetes Service's DNS name), since the replicas
    behind it are dialed by pod IP; '' for an IP literal (checked as is)."""
    host, _ = split_address(service_address)
    try:
        ipaddress.ip_address(host)
        return ""
    except ValueError:
        return host


@dataclass(frozen=True)
class Dialer:
    """Opens the channel to one replica of a service. The certificate files
    are read per channel, so a replica found after a renewal gets the new
    client certificate (channels already open keep theirs)."""

    tls: ClientTls | None = None

    def channel(self, service_address: str, replica_address: str) -> grpc.aio.Channel:
        if self.tls is None:
            return channel_to(replica_address)
        return channel_to(replica_address, credentials=self.tls.channel_credentials(),
                          server_name=server_name_of(service_address))


def downstream_dialer(cfg: OrchestratorConfig, insecure: bool) -> Dialer:
    """Mutual TLS to the services when --downstream-ca is given; plaintext
    otherwise, which only loopback addresses or --insecure allow."""
    client = ClientTls(cfg.downstream_ca, cfg.downstream_cert, cfg.downstream_key).validate(
        "--downstream-ca/--downstream-cert/--downstream-key")
    if client.enabled:
        return Dialer(client)
    for name, address in (("target", cfg.target), ("draft", cfg.draft)):
        if address:
            refuse_plaintext(split_address(address)[0], f"dialing the {name} service", insecure,
                             remedy="--downstream-ca/--downstream-cert/--downstream-key")
    return Dialer()
