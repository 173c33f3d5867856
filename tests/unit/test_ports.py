"""Ports for a local head and its servers: picked where nothing else takes them first
(local_ray.free_port), and named when a head could not listen on its own (cluster._error_line)."""

from __future__ import annotations

import socket
import subprocess

import pytest

from atomr_infer.cluster import _error_line
from atomr_infer.local_ray import _FIXED_ELSEWHERE, _OWN_PORTS_FROM, _ephemeral_ports_from, bind_error, free_port


@pytest.mark.skipif(_ephemeral_ports_from() - _OWN_PORTS_FROM < 1000,
                    reason=f"ephemeral ports start at {_ephemeral_ports_from()}: too few below them for 200 picks")
def test_free_ports_come_from_below_the_range_the_os_hands_out_and_never_twice():
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(_OWN_PORTS_FROM <= port < _ephemeral_ports_from() for port in ports), ports
    assert not any(port in _FIXED_ELSEWHERE for port in ports)
    assert all(bind_error(port) is None for port in ports)


def test_an_outgoing_connections_local_port_is_not_bindable_and_not_handed_out():
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as out:
        held = out.getsockname()[1]
        accepted, _ = server.accept()
        with accepted:
            assert bind_error(held) is not None and bind_error(held, "127.0.0.1") is not None
            assert free_port(preferred=held) != held


def test_a_port_another_address_listens_on_is_free_for_a_head_on_127_0_0_1_only():
    with socket.create_server(("127.0.0.2", 0)) as elsewhere:
        port = elsewhere.getsockname()[1]
        assert bind_error(port, "127.0.0.1") is None  # where the GCS listens
        assert bind_error(port) is not None  # every interface: free_port takes another
        assert free_port(preferred=port) != port


def test_a_port_left_in_time_wait_is_bindable_as_servers_bind_it():
    # Ray's gRPC servers and uvicorn set SO_REUSEADDR: a head stopped a moment ago (its closed
    # connections in TIME_WAIT on its port) must not read as a port in use.
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server's side closes first: its port goes to TIME_WAIT
        client.close()
    assert bind_error(port) is None
    assert free_port(preferred=port) == port


# What `ray start --head` printed (Ray 2.60) when its GCS port was taken after atomr's check;
# its last line, all atomr's error showed before, points at a log and names no cause.
RAY_START_ON_A_TAKEN_PORT = """\
RuntimeError: Failed to start GCS.  Last 1 lines of error files:
[2026-11-28 02:14:32,416 C 28700 28700] (gcs_server) grpc_server.cc:134:  An unexpected system state has occurred. \
You have likely discovered a bug in Ray. Please report this issue at https://github.com/ray-project/ray/issues and \
we'll work with you to fix it. Check failed: server_ Failed to start the grpc server. The specified port is 55161. \
This means that Ray's core components will not be able to function correctly.

.Please check /tmp/rg/session_2026-11-28_02-14-32_204663_28698/logs/gcs_server.out for details. Last connection \
error: None
"""


def test_a_gcs_that_did_not_start_is_named_with_its_own_reason():
    failed = subprocess.CompletedProcess(["ray", "start"], 1, stdout="", stderr=RAY_START_ON_A_TAKEN_PORT)
    assert _error_line(failed) == \
        "its GCS did not start: Failed to start the grpc server. The specified port is 55161."
    other = subprocess.CompletedProcess(["ray", "start"], 1, stdout="", stderr="ValueError: bad --num-cpus\n")
    assert _error_line(other) == "ValueError: bad --num-cpus"
    unknown = RAY_START_ON_A_TAKEN_PORT.replace("server_ Failed to start the grpc server. The specified port is 55161.",
                                                "port_ > 0 \n")
    assert _error_line(subprocess.CompletedProcess(["ray", "start"], 1, stdout="", stderr=unknown)).startswith(
        ".Please check /tmp/rg/session_")  # an unknown check's text is not cut into a wrong sentence
