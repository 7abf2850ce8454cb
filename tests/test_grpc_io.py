"""The grpc I/O engine the roles choose before grpc starts (specdec/rpc/grpc_io.py)."""
from __future__ import annotations

import os

import pytest

from specdec.rpc import grpc_io

IOMGR_EXPERIMENTS = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"


def test_iomgr_is_the_default_and_turns_the_event_engine_experiments_off():
    env: dict[str, str] = {}
    assert grpc_io.choose(env) == grpc_io.IOMGR
    assert env["GRPC_EXPERIMENTS"] == IOMGR_EXPERIMENTS
    assert grpc_io.describe(env).startswith("grpc iomgr")


def test_event_engine_leaves_grpc_alone():
    env = {"SPECD_GRPC_IO": "Event-Engine "}
    assert grpc_io.choose(env) == grpc_io.EVENT_ENGINE
    assert "GRPC_EXPERIMENTS" not in env
    assert "EventEngine" in grpc_io.describe(env)


def test_a_users_own_grpc_experiments_win():
    env = {"GRPC_EXPERIMENTS": "tcp_rcv_lowat", "SPECD_GRPC_IO": "iomgr"}
    assert grpc_io.choose(env) == "user"
    assert env["GRPC_EXPERIMENTS"] == "tcp_rcv_lowat"
    assert grpc_io.describe(env) == "GRPC_EXPERIMENTS=tcp_rcv_lowat"


def test_an_unknown_engine_is_a_clear_error_from_the_cli(monkeypatch, capsys):
    with pytest.raises(ValueError, match="SPECD_GRPC_IO='epoll': use one of iomgr, event-engine"):
        grpc_io.chosen({"SPECD_GRPC_IO": "epoll"})
    from specdec.cli.main import main

    monkeypatch.setenv("SPECD_GRPC_IO", "epoll")
    assert main(["models", "list"]) == 2
    assert "SPECD_GRPC_IO='epoll'" in capsys.readouterr().err


def test_importing_specdec_chose_the_engine_for_this_process():
    # conftest imports specdec before any grpc channel exists; CI sets no GRPC_EXPERIMENTS of its own.
    assert "event_engine_client" in os.environ.get("GRPC_EXPERIMENTS", "")
