"""Transport security and credentials, against live servers on 127.0.0.1:0
with certificates made in the test (specdec.security.local_ca):

- the model services serve mutual TLS: no client certificate, a certificate
  from another CA, or one of our CA's naming someone other than the
  orchestrator is refused; the orchestrator's is served; health checks stay
  open (the plaintext health-only port for probes);
- the orchestrator verifies a replica dialed by IP against the Service's name;
- a session quota per caller identity: one caller at its quota gets
  RESOURCE_EXHAUSTED while another is still served;
- the orchestrator's front doors: a missing or wrong API key is UNAUTHENTICATED
  (gRPC) and 401 in OpenAI's error JSON (HTTP, the official client); the
  right one is served, over TLS;
- plaintext away from loopback is refused unless asked for;
- `specd up --tls`'s certificates and flags make a full generate work.
"""
from __future__ import annotations

import os
import ssl
import subprocess
import sys

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.client import Client
from orchestrator.config import OrchestratorConfig
from orchestrator.openai_api.config import HttpConfig
from orchestrator.security import Dialer, downstream_dialer
from orchestrator.server import start_orchestrator
from specdec.cli.main import build_parser
from specdec.config import from_args
from specdec.rpc.session_limits import SessionLimits
from specdec.rpc.serving import ServerConfig
from specdec.security.api_keys import ApiKeyChecker, ApiKeyError, load_api_keys
from specdec.security.local_ca import LocalCA, LocalTls
from specdec.security.tls import ClientTls, TlsConfig, TlsSettingsError
from specdec.v1 import common_pb2, target_pb2_grpc
from target_service.server import start_target_service
from target_service.verifier import Verifier
from tests.conftest import tiny_engine, tiny_model
from tests.harness import BackgroundLoop, local_config
from tests.test_orchestrator import greedy_reference, perturbed

DEADLINE_S = 30.0
KEY = "sk-right-key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Our CA's certificates for the roles and for a stranger, and another CA's 'orchestrator'."""
    ours = tmp_path_factory.mktemp("ours")
    ca = LocalCA.create("test CA")
    files = {name: ca.write_role(ours, name) for name in ("orchestrator", "orchestrator-b", "target", "intruder")}
    # The target's certificate as in Kubernetes: the Service's name only, no IP.
    files["target-by-name"] = ca.write_role(ours / "by-name", "target", hosts=("specdec-target",))
    files["other-ca"] = LocalCA.create("another CA").write_role(tmp_path_factory.mktemp("theirs"), "orchestrator")
    return files


def service_tls(pki, cert: str = "target", allowed: str = "orchestrator") -> TlsConfig:
    return TlsConfig(tls_cert=pki[cert].cert, tls_key=pki[cert].key, tls_ca=pki[cert].ca, allowed_callers=allowed)


class TargetUnderTest:
    """A target service on 127.0.0.1:0 over mutual TLS, with a health-only port."""

    def __init__(self, tls: TlsConfig, limits: SessionLimits | None = None, engine=None):
        self.engine = engine if engine is not None else tiny_engine()
        self.limits = limits or SessionLimits()
        self.loop = BackgroundLoop()
        cfg = ServerConfig(host="127.0.0.1", port=0, health_port=0)
        self.service = self.loop.run(start_target_service(
            cfg, self.limits, lambda: Verifier(self.engine, self.limits.max_draft_tokens,
                                               self.limits.max_verify_batch), tls=tls))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.service.port}"

    def close(self):
        self.loop.run(self.service.stop(0))
        self.loop.close()


@pytest.fixture(scope="module")
def target(pki):
    service = TargetUnderTest(service_tls(pki, allowed="orchestrator,orchestrator-b"),
                              SessionLimits(max_sessions_per_caller=2))
    yield service
    service.close()


def https_client(ca: str):
    """The openai package's own HTTP client, trusting `ca`."""
    return openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=ca))


def tls_channel(address: str, files=None, ca: str | None = None, server_name: str = "") -> grpc.Channel:
    creds = ClientTls(ca=ca or (files.ca if files else ""), cert=files.cert if files else "",
                      key=files.key if files else "").channel_credentials()
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, creds, options=options)


def model_info(channel: grpc.Channel):
    return target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest(),
                                                                   timeout=DEADLINE_S)


def health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S).status


def refused_with(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


# -------------------------------------------------------------- mutual TLS at the services

def test_a_caller_without_a_certificate_is_refused(target, pki):
    with tls_channel(target.address, ca=pki["target"].ca) as channel:  # verifies the server, presents nothing
        assert refused_with(lambda: model_info(channel)).code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(target.address) as channel:
        assert refused_with(lambda: model_info(channel)).code() == grpc.StatusCode.UNAVAILABLE


def test_a_certificate_from_another_ca_is_refused(target, pki):
    theirs = pki["other-ca"]
    with tls_channel(target.address, theirs, ca=pki["target"].ca) as channel:
        assert refused_with(lambda: model_info(channel)).code() == grpc.StatusCode.UNAVAILABLE


def test_our_ca_is_not_enough_the_certificate_must_name_the_orchestrator(target, pki):
    with tls_channel(target.address, pki["intruder"]) as channel:
        error = refused_with(lambda: model_info(channel))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "intruder" in error.details() and "orchestrator" in error.details()
        stub = target_pb2_grpc.TargetServiceStub(channel)
        error = refused_with(lambda: stub.OpenSession(common_pb2.OpenSessionRequest(prompt_token_ids=[1, 2]),
                                                      timeout=DEADLINE_S))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        # Health stays open to anyone through the handshake.
        assert health(channel) == health_pb2.HealthCheckResponse.SERVING
    assert target.engine.num_sessions == 0


def test_the_orchestrator_certificate_is_served(target, pki):
    with tls_channel(target.address, pki["orchestrator"]) as channel:
        assert model_info(channel).info.vocab_size == target.engine.vocab_size
        stub = target_pb2_grpc.TargetServiceStub(channel)
        opened = stub.OpenSession(common_pb2.OpenSessionRequest(prompt_token_ids=[1, 2, 3]), timeout=DEADLINE_S)
        assert opened.length == 3
        stub.CloseSession(common_pb2.CloseSessionRequest(session_id=opened.session_id), timeout=DEADLINE_S)


def test_probes_reach_the_plaintext_health_only_port(target, pki):
    port = target.service.running.health_port
    assert port > 0 and port != target.service.port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        assert health(channel) == health_pb2.HealthCheckResponse.SERVING
        request = health_pb2.HealthCheckRequest(service="specdec.v1.TargetService")
        assert health_pb2_grpc.HealthStub(channel).Check(request, timeout=DEADLINE_S).status == \
            health_pb2.HealthCheckResponse.SERVING
        # Nothing but health there.
        assert refused_with(lambda: model_info(channel)).code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_replica_dialed_by_ip_is_verified_against_the_service_name(pki):
    service = TargetUnderTest(service_tls(pki, "target-by-name"))
    try:
        port = service.service.port
        # The certificate names specdec-target, not 127.0.0.1: checking the IP fails...
        with tls_channel(service.address, pki["orchestrator"]) as channel:
            assert refused_with(lambda: model_info(channel)).code() == grpc.StatusCode.UNAVAILABLE
        # ...and the orchestrator checks the name it was given instead.
        cfg = OrchestratorConfig(target=f"specdec-target:{port}", draft="", downstream_ca=pki["orchestrator"].ca,
                                 downstream_cert=pki["orchestrator"].cert, downstream_key=pki["orchestrator"].key)
        dialer = downstream_dialer(cfg, insecure=False)

        async def info():
            channel = dialer.channel(cfg.target, service.address)
            try:
                return await target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(
                    common_pb2.GetModelInfoRequest(), timeout=DEADLINE_S)
            finally:
                await channel.close()

        assert service.loop.run(info()).info.vocab_size == service.engine.vocab_size
    finally:
        service.close()


def test_a_renewed_certificate_is_served_without_a_restart(tmp_path, pki):
    ca = LocalCA.create("rotating CA")
    files = ca.write_role(tmp_path, "target", hosts=("name-one",))
    client = ca.write_role(tmp_path / "client", "orchestrator")
    service = TargetUnderTest(TlsConfig(tls_cert=files.cert, tls_key=files.key, tls_ca=files.ca))
    try:
        def served_as(name: str) -> bool:
            with tls_channel(service.address, client, server_name=name) as channel:
                try:
                    return model_info(channel).info.vocab_size > 0
                except grpc.RpcError:
                    return False

        assert served_as("name-one") and not served_as("name-two")
        renewed = ca.write_role(tmp_path / "renewed", "target", hosts=("name-two",))
        for new, old in ((renewed.key, files.key), (renewed.cert, files.cert)):
            os.replace(new, old)  # as the kubelet swaps a Secret's files
        assert served_as("name-two") and not served_as("name-one")
    finally:
        service.close()


# -------------------------------------------------------------- sessions per caller

def test_one_caller_at_its_quota_does_not_starve_another(target, pki):
    with tls_channel(target.address, pki["orchestrator"]) as a_channel, \
            tls_channel(target.address, pki["orchestrator-b"]) as b_channel:
        a, b = target_pb2_grpc.TargetServiceStub(a_channel), target_pb2_grpc.TargetServiceStub(b_channel)

        def open_session(stub):
            return stub.OpenSession(common_pb2.OpenSessionRequest(prompt_token_ids=[1, 2]), timeout=DEADLINE_S)

        held = [open_session(a), open_session(a)]
        error = refused_with(lambda: open_session(a))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "cert:orchestrator " in error.details() and "quota" in error.details()
        other = open_session(b)  # another identity is still served
        a.CloseSession(common_pb2.CloseSessionRequest(session_id=held[0].session_id), timeout=DEADLINE_S)
        held[0] = open_session(a)  # a closed session frees its place
        for stub, opened in ((a, held[0]), (a, held[1]), (b, other)):
            stub.CloseSession(common_pb2.CloseSessionRequest(session_id=opened.session_id), timeout=DEADLINE_S)
    assert target.engine.num_sessions == 0


# -------------------------------------------------------------- the orchestrator's front doors

@pytest.fixture(scope="module")
def secured_system(pki, tmp_path_factory):
    """Target (mutual TLS) + orchestrator with TLS at both front doors and API keys in a file."""
    from tests.test_openai_api import tiny_text_pair

    tokenizer, target_model, _ = tiny_text_pair()
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"# one key per line\n{KEY}\n\nsk-second-key\n")
    service = TargetUnderTest(service_tls(pki), engine=tiny_engine(model=target_model))
    own = pki["orchestrator"]
    cfg = OrchestratorConfig(target=service.address, draft="", connect_timeout_s=10, api_key_file=str(keys),
                             downstream_ca=own.ca, downstream_cert=own.cert, downstream_key=own.key)
    tls = TlsConfig(tls_cert=own.cert, tls_key=own.key)
    orch = service.loop.run(start_orchestrator(local_config(), cfg, tokenizer=tokenizer, http=HttpConfig(http_port=0),
                                               tls=tls))
    try:
        yield orch, own
    finally:
        service.loop.run(orch.stop(0))
        service.close()


def test_grpc_front_door_refuses_a_missing_or_wrong_key_and_serves_the_right_one(secured_system):
    orch, own = secured_system
    address = f"127.0.0.1:{orch.port}"
    for key in (None, "sk-wrong"):
        with Client(address, timeout_s=DEADLINE_S, api_key=key, tls=ClientTls(ca=own.ca)) as client:
            error = refused_with(lambda: client.complete([1, 2, 3], max_tokens=4, temperature=0))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert KEY not in error.details()
    with Client(address, timeout_s=DEADLINE_S, api_key=KEY, tls=ClientTls(ca=own.ca)) as client:
        result = client.complete([1, 2, 3], max_tokens=4, temperature=0)
        assert len(result.token_ids) == 4
    with tls_channel(address, ca=own.ca) as channel:  # health needs no key
        assert health(channel) == health_pb2.HealthCheckResponse.SERVING
    with Client(address, timeout_s=DEADLINE_S, api_key=KEY) as plaintext:  # the port speaks TLS only
        assert refused_with(lambda: plaintext.complete([1, 2, 3], max_tokens=4)).code() == grpc.StatusCode.UNAVAILABLE


def test_specd_generate_sends_the_key_over_tls(secured_system, capsys, monkeypatch):
    import json

    from specdec.cli.main import main

    orch, own = secured_system
    command = ["generate", "--server", f"127.0.0.1:{orch.port}", "--ca-cert", own.ca, "--prompt-ids", "1,2,3",
               "--max-tokens", "4", "--temperature", "0", "--json", "--timeout", "60"]
    assert main([*command, "--api-key", "sk-wrong"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("SPECD_API_KEY", KEY)  # read when the parser is built
    assert main(command) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 4


def test_http_front_door_answers_401_in_openai_shape_and_serves_the_right_key(secured_system):
    orch, own = secured_system
    base = f"https://127.0.0.1:{orch.http.port}"
    for key in ("sk-wrong", ""):
        http = https_client(own.ca)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key or "unused", max_retries=0, timeout=DEADLINE_S,
                               http_client=http, default_headers={} if key else {"Authorization": ""})
        with pytest.raises(openai.AuthenticationError) as caught:
            client.completions.create(model="x", prompt="the quick", max_tokens=4, temperature=0)
        assert caught.value.status_code == 401
        error = caught.value.body
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert caught.value.response.headers["www-authenticate"] == "Bearer"
        client.close()
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=DEADLINE_S,
                           http_client=https_client(own.ca))
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt="the quick", max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4
    client.close()
    with https_client(own.ca) as http:
        assert http.get(f"{base}/health").status_code == 200  # health needs no key
        missing = http.post(f"{base}/v1/completions", content=b"not even json")
        assert missing.status_code == 401  # refused before the body is read
        assert "required" in missing.json()["error"]["message"]


# -------------------------------------------------------------- settings

def test_plaintext_away_from_loopback_needs_insecure(pki):
    with pytest.raises(TlsSettingsError, match="--insecure"):
        TlsConfig().validate("0.0.0.0", "target", require_client_certs=True)
    TlsConfig(insecure=True).validate("0.0.0.0", "target", require_client_certs=True)
    TlsConfig().validate("127.0.0.1", "target", require_client_certs=True)
    TlsConfig().validate("localhost", "target", require_client_certs=True)
    with pytest.raises(TlsSettingsError, match="--downstream-ca"):
        downstream_dialer(OrchestratorConfig(target="specdec-target:50053", draft=""), insecure=False)
    assert downstream_dialer(OrchestratorConfig(target="specdec-target:50053", draft=""), insecure=True) == Dialer()
    with pytest.raises(TlsSettingsError, match="--tls-ca"):  # a service serves TLS only mutually
        TlsConfig(tls_cert=pki["target"].cert, tls_key=pki["target"].key).validate("0.0.0.0", "target", True)
    with pytest.raises(TlsSettingsError, match="go together"):
        TlsConfig(tls_cert=pki["target"].cert).validate("127.0.0.1", "target", True)
    with pytest.raises(TlsSettingsError, match="cannot read"):
        TlsConfig(tls_cert="/nonexistent.crt", tls_key="/nonexistent.key", tls_ca="/x").validate("::1", "target", True)


def test_specd_serve_refuses_plaintext_on_every_interface_in_one_line():
    result = subprocess.run([sys.executable, "-m", "specdec.cli.main", "serve", "target", "--host", "0.0.0.0",
                             "--port", "0", "--model", "synth:nothing"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "--insecure" in result.stderr and "Traceback" not in result.stderr


def test_api_keys_from_a_file_and_the_environment(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\n  k1  \n\nk2\n")
    keys = load_api_keys(str(path), environ={"SPECD_API_KEYS": "k3, k1"})
    assert sorted(keys) == [b"k1", b"k2", b"k3"]
    checker = ApiKeyChecker(keys)
    assert checker.problem("Bearer k2") is None and checker.problem("bearer k3") is None
    assert "required" in checker.problem(None)
    assert "Bearer" in checker.problem("Basic azE=")
    assert "not valid" in checker.problem("Bearer k4")
    assert ApiKeyChecker(()).problem(None) is None  # no keys configured: none required
    path.write_text("# only a comment\n")
    with pytest.raises(ApiKeyError, match="holds no key"):
        load_api_keys(str(path), environ={})
    with pytest.raises(ApiKeyError, match="cannot read"):
        load_api_keys(str(tmp_path / "missing"), environ={})


def test_an_api_key_file_with_a_byte_order_mark_keeps_its_first_key(tmp_path):
    """An editor's BOM was read as part of the first key, which was then
    refused with nothing to say why."""
    path = tmp_path / "keys"
    path.write_bytes("\ufeffk1\nk2\n".encode("utf-8"))
    keys = load_api_keys(str(path), environ={})
    assert ApiKeyChecker(keys).problem("Bearer k1") is None


@pytest.mark.parametrize("key", ["clé", "two words", "tab\tkey"])
def test_a_key_no_client_can_send_is_refused_as_it_is_loaded(tmp_path, key):
    path = tmp_path / "keys"
    path.write_text(f"good\n{key}\n", encoding="utf-8")
    with pytest.raises(ApiKeyError, match="key 2 of the API key file .* printable ASCII"):
        load_api_keys(str(path), environ={})
    with pytest.raises(ApiKeyError, match="SPECD_API_KEYS"):
        load_api_keys("", environ={"SPECD_API_KEYS": f"good,{key}"})
    path.write_bytes(b"\xff\xfek\n")
    with pytest.raises(ApiKeyError, match="not UTF-8"):
        load_api_keys(str(path), environ={})


def test_a_private_key_written_over_a_readable_file_is_made_private(tmp_path):
    """O_CREAT's mode applies to new files only: a NAME.key that was there
    with mode 0644 stayed world-readable."""
    import os
    import stat

    stale = tmp_path / "orchestrator.key"
    stale.write_text("old")
    os.chmod(stale, 0o644)
    files = LocalCA.create().write_role(tmp_path, "orchestrator")
    assert stat.S_IMODE(os.stat(files.key).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(files.cert).st_mode) == 0o644


# -------------------------------------------------------------- specd up --tls

def test_specd_up_tls_certificates_and_flags_make_a_full_generate_work(tmp_path):
    """The roles parsed from the very flags `specd up --tls` passes, then a
    generate through the orchestrator over TLS with mutual TLS behind it."""
    from draft_service.drafters import ModelDrafter
    from draft_service.server import start_draft_service

    local = LocalTls.create(tmp_path)
    parser = build_parser()

    def parsed(role: str, *extra: str):
        return parser.parse_args(["serve", role, *extra, *local.flags(role)])

    target_model = tiny_model(seed=0, init_range=0.3)
    target_engine, draft_engine = tiny_engine(model=target_model), tiny_engine(model=perturbed(target_model, 0.15, 1))
    loop = BackgroundLoop()
    started = []
    try:
        target = loop.run(start_target_service(local_config(), SessionLimits(),
                                                lambda: Verifier(target_engine, 8, 64),
                                                tls=from_args(TlsConfig, parsed("target"))))
        started.append(target)
        draft = loop.run(start_draft_service(local_config(), SessionLimits(), lambda: ModelDrafter(draft_engine, 8, 32),
                                             tls=from_args(TlsConfig, parsed("draft"))))
        started.append(draft)
        args = parsed("orchestrator", "--target", f"127.0.0.1:{target.port}", "--draft", f"127.0.0.1:{draft.port}")
        cfg = from_args(OrchestratorConfig, args, connect_timeout_s=10)
        orch = loop.run(start_orchestrator(local_config(), cfg, tls=from_args(TlsConfig, args)))
        started.append(orch)
        with Client(f"127.0.0.1:{orch.port}", timeout_s=60, tls=ClientTls(ca=local.ca)) as client:
            tls_result = client.complete([5, 6, 7], max_tokens=12, temperature=0)
        # The draft took part (over mutual TLS), and greedy output is the target's own.
        assert tls_result.stats.proposed_tokens > 0 and tls_result.stats.fallback_rounds == 0
        assert tls_result.token_ids == greedy_reference(target_model, [5, 6, 7], 12)
    finally:
        for server in reversed(started):
            loop.run(server.stop(0))
        loop.close()


def test_the_orchestrator_front_doors_can_require_client_certificates_too(pki):
    """--tls-ca on the orchestrator: both front doors want a client certificate."""
    from orchestrator.openai_api.server import start_http
    from specdec.rpc.serving import start_server
    from specdec.telemetry import NOOP

    own = pki["orchestrator"]
    tls = TlsConfig(tls_cert=own.cert, tls_key=own.key, tls_ca=own.ca).validate("127.0.0.1", "orchestrator", False)
    loop = BackgroundLoop()
    running = loop.run(start_server(local_config(), lambda server: None, [], credentials=tls.server_credentials()))
    front = loop.run(start_http(HttpConfig(http_port=0), "127.0.0.1", NOOP, tls=tls))
    try:
        with tls_channel(f"127.0.0.1:{running.port}", ca=own.ca) as channel:
            assert refused_with(lambda: health(channel)).code() == grpc.StatusCode.UNAVAILABLE
        with tls_channel(f"127.0.0.1:{running.port}", pki["intruder"]) as channel:  # any name of the CA will do
            assert health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        url = f"https://127.0.0.1:{front.port}/health"
        with https_client(own.ca) as http, pytest.raises(Exception):  # no certificate: no response at all
            http.get(url)
        context = ssl.create_default_context(cafile=own.ca)
        context.load_cert_chain(pki["intruder"].cert, pki["intruder"].key)
        with openai.DefaultHttpxClient(verify=context) as http:
            assert http.get(url).status_code == 503  # through the handshake; not ready (no services here)
    finally:
        loop.run(front.stop(0))
        loop.run(running.drain(0))
        loop.close()


def test_the_http_port_serves_a_renewed_certificate_without_a_restart(tmp_path):
    """From the next connection on, as the gRPC port. Half a rotation (the
    certificate renewed, its key not yet) keeps the old pair serving: loaded
    into the live context, it left the port with a certificate and no key,
    refusing every handshake until the key came."""
    import time

    from orchestrator.openai_api import server as http_server
    from specdec.telemetry import NOOP

    old_ca, new_ca = LocalCA.create("old CA"), LocalCA.create("new CA")
    files = old_ca.write_role(tmp_path, "orchestrator")
    renewed = new_ca.write_role(tmp_path / "renewed", "orchestrator")
    loop = BackgroundLoop()
    front = loop.run(http_server.start_http(HttpConfig(http_port=0), "127.0.0.1", NOOP,
                                            tls=TlsConfig(tls_cert=files.cert, tls_key=files.key)))
    url = f"https://127.0.0.1:{front.port}/health"

    def trusted_by_new_ca() -> bool:
        try:
            with https_client(renewed.ca) as http:
                return http.get(url).status_code == 503  # served (not ready: no services here)
        except Exception:  # noqa: BLE001 - certificate verification failed
            return False

    def trusted_by_old_ca() -> bool:
        with https_client(files.ca) as http:
            return http.get(url).status_code == 503

    try:
        assert not trusted_by_new_ca() and trusted_by_old_ca()
        os.replace(renewed.cert, files.cert)  # the key comes later
        assert trusted_by_old_ca() and trusted_by_old_ca()
        os.replace(renewed.key, files.key)
        deadline = time.monotonic() + DEADLINE_S
        while not trusted_by_new_ca():
            assert time.monotonic() < deadline, "the renewed certificate was never served"
            time.sleep(0.05)
    finally:
        loop.run(front.stop(0))
        loop.close()


def test_the_http_port_trusts_a_ca_added_to_its_bundle_without_a_restart(tmp_path):
    """The first step of a CA rotation (the bundle gains the new CA) reached
    the gRPC port and not the HTTP port, which read --tls-ca once."""
    from orchestrator.openai_api import server as http_server
    from specdec.telemetry import NOOP

    old_ca, new_ca = LocalCA.create("old CA"), LocalCA.create("new CA")
    own = old_ca.write_role(tmp_path, "orchestrator")
    newcomer = new_ca.write_role(tmp_path / "new", "client")
    tls = TlsConfig(tls_cert=own.cert, tls_key=own.key, tls_ca=own.ca)
    loop = BackgroundLoop()
    front = loop.run(http_server.start_http(HttpConfig(http_port=0), "127.0.0.1", NOOP, tls=tls))
    url = f"https://127.0.0.1:{front.port}/health"

    def served() -> bool:
        context = ssl.create_default_context(cafile=own.ca)
        context.load_cert_chain(newcomer.cert, newcomer.key)
        try:
            with openai.DefaultHttpxClient(verify=context) as http:
                return http.get(url).status_code == 503  # through the handshake; not ready
        except Exception:  # noqa: BLE001 - the handshake failed: the client's CA is not trusted
            return False

    try:
        assert not served()
        with open(own.ca, "ab") as bundle:
            bundle.write(new_ca.cert_pem)
        assert served()
    finally:
        loop.run(front.stop(0))
        loop.close()


def test_a_comma_separated_list_of_replicas_is_judged_entry_by_entry():
    """Every entry of a replica list must be loopback for plaintext without
    --insecure, and a list has no one Service name to verify against."""
    from orchestrator.security import hosts_of, server_name_of

    assert hosts_of("127.0.0.1:5001,127.0.0.1:5002") == ["127.0.0.1", "127.0.0.1"]
    assert server_name_of("127.0.0.1:5001,127.0.0.1:5002") == ""
    assert server_name_of("specdec-target:50053") == "specdec-target"
    assert server_name_of("10.0.0.7:50053") == ""
    cfg = OrchestratorConfig(target="127.0.0.1:5001,127.0.0.1:5002", draft="127.0.0.1:5003")
    downstream_dialer(cfg, insecure=False)  # all loopback: plaintext allowed
    remote = OrchestratorConfig(target="127.0.0.1:5001,10.1.2.3:5002", draft="127.0.0.1:5003")
    with pytest.raises(TlsSettingsError, match="10.1.2.3"):
        downstream_dialer(remote, insecure=False)
    downstream_dialer(remote, insecure=True)


def test_the_client_warns_before_sending_an_api_key_in_plaintext_off_loopback():
    import warnings

    from orchestrator.client import Client

    with pytest.warns(UserWarning, match="API key goes to example.com:50051 in plaintext"):
        Client("example.com:50051", api_key="k").channel.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for address in ("127.0.0.1:50051", "[::1]:50051", "localhost:50051"):
            Client(address, api_key="k").channel.close()
        Client("example.com:50051").channel.close()  # no key, nothing to leak
