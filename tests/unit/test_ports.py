"""Ports for a local head and its servers: picked where nothing else takes them first
(local_ray.free_port), and named when a head could not listen on its own (cluster._error_line)."""

from __future__ import annotations

import socket
import subprocess

from atomr_infer.cluster import _error_line
from atomr_infer.local_ray import _ephemeral_ports_from, free_port, port_bindable


def test_free_ports_come_from_below_the_range_the_os_hands_out_and_never_twice():
    # A CI run failed because a port picked from the ephemeral range became the local port of
    # some process's outgoing connection before the GCS bound it.
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= port < _ephemeral_ports_from() for port in ports), ports
    assert all(port_bindable(port) for port in ports)


def test_an_outgoing_connections_local_port_is_not_bindable_and_not_handed_out():
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as out:
        held = out.getsockname()[1]
        accepted, _ = server.accept()
        with accepted:
            assert not port_bindable(held)
            assert free_port(preferred=held) != held


def test_a_port_left_in_time_wait_is_bindable_as_servers_bind_it():
    # Ray's gRPC servers and uvicorn set SO_REUSEADDR: a head stopped a moment ago (its closed
    # connections in TIME_WAIT on its port) must not read as a port in use.
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server's side closes first: its port goes to TIME_WAIT
        client.close()
    assert port_bindable(port)
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
