"""Monarch's bootstrap names refuse what raymesh cannot honour before anything starts: a CA
file or key (Ray's TLS secures the cluster), a malformed or wildcard address, a worker list
that is a string, empty or repeats a host. Each message names the field, the value and the fix,
and a refused call starts no node (no `ray start`) and waits for none."""

from __future__ import annotations

from pathlib import Path

import pytest

from raymesh.actor import attach_to_workers, run_worker_loop_forever

GOOD = "tcp://worker-3:26600"


@pytest.mark.parametrize(
    ("ca", "key", "said"),
    [
        (b"-----BEGIN CERTIFICATE-----", None, "ca=b'-----BEGIN"),
        (Path("/etc/ssl/ca.pem"), None, "ca=PosixPath('/etc/ssl/ca.pem')"),
        ("trust_all_connections", b"secret-key-bytes", "private_key=<given>"),
    ],
)
def test_a_ca_file_or_a_private_key_is_refused_naming_rays_tls_and_never_echoing_the_key(
    ca, key, said
):
    for call in (
        lambda: run_worker_loop_forever(address=GOOD, ca=ca, private_key=key, cluster="h:6379"),
        lambda: attach_to_workers(workers=[GOOD], ca=ca, private_key=key, timeout=0.1),
    ):
        with pytest.raises(ValueError) as refused:
            call()
        message = str(refused.value)
        assert said in message and "RAY_USE_TLS" in message and "trust_all_connections" in message
        assert "secret-key-bytes" not in message


@pytest.mark.parametrize(
    ("address", "fix"),
    [
        ("worker-3:26600", "'tcp://worker-3:26600'"),
        ("tcp://", "'tcp://worker-3:26600'"),
        (26600, "'tcp://worker-3:26600'"),
        ("tcp://*:26600", "a wildcard cannot name one host"),
    ],
)
def test_a_malformed_address_is_refused_by_both_names(address, fix):
    with pytest.raises(ValueError, match=r"^address=") as refused:
        run_worker_loop_forever(address=address, ca="trust_all_connections", cluster="h:6379")
    assert repr(address) in str(refused.value) and fix in str(refused.value)
    with pytest.raises(ValueError, match=r"^workers=") as refused:
        attach_to_workers(workers=[GOOD, address], ca="trust_all_connections", timeout=0.1)
    assert repr(address) in str(refused.value) and fix in str(refused.value)


@pytest.mark.parametrize(
    ("workers", "said"),
    [
        (GOOD, "give a list"),
        ([], "give a list"),
        ([GOOD, GOOD], "each worker once"),
    ],
)
def test_a_worker_list_that_is_a_string_empty_or_repeats_a_host_is_refused(workers, said):
    with pytest.raises(ValueError, match=said):
        attach_to_workers(workers=workers, ca="trust_all_connections", timeout=0.1)


def test_a_worker_with_no_cluster_to_join_is_told_which_to_give(monkeypatch):
    monkeypatch.delenv("RAYMESH_ADDRESS", raising=False)
    with pytest.raises(ValueError, match=r"cluster=None and RAYMESH_ADDRESS is unset"):
        run_worker_loop_forever(address=GOOD, ca="trust_all_connections")
