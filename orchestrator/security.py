"""The orchestrator's security wiring: how it dials the services (mutual TLS,
or plaintext where allowed) and what its front doors require (TLS, API keys).
The checks themselves live in specdec.security and specdec.rpc.auth."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import grpc

from orchestrator.config import OrchestratorConfig
from orchestrator.downstream import LaneDialing, channel_to
from orchestrator.replicas import split_address
from specdec.security.tls import ClientTls, refuse_plaintext


def hosts_of(service_address: str) -> list[str]:
    """The hosts of a configured address: one, or one per entry of a
    comma-separated list of replicas."""
    return [split_address(part)[0] for part in filter(None, (p.strip() for p in service_address.split(",")))]


def server_name_of(service_address: str) -> str:
    """The name a service's certificate must carry: the host of its
    configured address (a Kubernetes Service's DNS name), since the replicas
    behind it are dialed by pod IP; '' for an IP literal (checked as is). A
    comma-separated list names its replicas one by one: '' too, each
    replica's certificate is checked against the address it is dialed at."""
    hosts = hosts_of(service_address)
    return hosts[0] if len(hosts) == 1 and not _is_ip(hosts[0]) else ""


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


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

    def lane(self, service_address: str, replica_address: str) -> LaneDialing | None:
        """How to dial the replica's lane: TLS as its channel, or None for plaintext."""
        if self.tls is None:
            return None
        # The context is made per connection: a renewed client certificate is presented from the next one.
        return LaneDialing(self.tls.ssl_context,
                           server_name_of(service_address) or split_address(replica_address)[0])


def downstream_dialer(cfg: OrchestratorConfig, insecure: bool) -> Dialer:
    """Mutual TLS to the services when --downstream-ca is given; plaintext
    otherwise, which only loopback addresses or --insecure allow."""
    client = ClientTls(cfg.downstream_ca, cfg.downstream_cert, cfg.downstream_key).validate(
        "--downstream-ca/--downstream-cert/--downstream-key")
    if client.enabled:
        return Dialer(client)
    for name, address in (("target", cfg.target), ("draft", cfg.draft)):
        for host in hosts_of(address) if address else ():
            refuse_plaintext(host, f"dialing the {name} service", insecure,
                             remedy="--downstream-ca/--downstream-cert/--downstream-key")
    return Dialer()
