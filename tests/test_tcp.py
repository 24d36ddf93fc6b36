"""Congestion control and unsent bytes of local connections (commbench.comm.tcp): the choice, and
real sockets."""

from __future__ import annotations

import os
import socket

import pytest

from commbench.comm import tcp


@pytest.mark.parametrize(
    ("current", "chosen", "expected"),
    [
        ("bbr", "auto", "reno"),
        ("bbr3", "auto", "reno"),
        ("cubic", "auto", None),
        (None, "auto", None),
        ("bbr", "keep", None),
        ("cubic", "keep", None),
        ("cubic", "cubic", None),
        ("bbr", "cubic", "cubic"),
        ("reno", "bbr", "bbr"),
    ],
)
def test_what_a_local_connection_should_use(current, chosen, expected):
    assert tcp.local_choice(current, chosen) == expected


@pytest.mark.parametrize(
    ("me", "peer", "local"),
    [
        (("127.0.0.1", 5), ("127.0.0.1", 6), True),
        (("127.0.0.1", 5), ("127.0.1.1", 6), True),
        (("10.0.0.1", 5), ("10.0.0.1", 6), True),  # two ranks bound to the host's own address
        (("10.0.0.1", 5), ("10.0.0.2", 6), False),
        (("::ffff:127.0.0.1", 5, 0, 0), ("::ffff:127.0.0.1", 6, 0, 0), True),
        (("::1", 5, 0, 0), ("::1", 6, 0, 0), True),
        (("fe80::1%eth0", 5, 0, 2), ("fe80::2%eth0", 6, 0, 2), False),
        (("10.0.0.1", 5), ("not an address", 6), False),
    ],
)
def test_which_connections_stay_on_the_host(me, peer, local):
    assert tcp.same_host(me, peer) is local


def test_the_setting_is_checked_against_what_the_kernel_has(monkeypatch):
    monkeypatch.setattr(tcp, "available", lambda: ["reno", "cubic"])
    assert tcp.setting({}) == "auto"
    assert tcp.setting({tcp.CC_ENV: " "}) == "auto"
    assert tcp.setting({tcp.CC_ENV: "keep"}) == "keep"
    assert tcp.setting({tcp.CC_ENV: "cubic"}) == "cubic"
    with pytest.raises(ValueError, match=r"COMMBENCH_LOOPBACK_CC='vegas'.*auto, keep or one of: reno, cubic"):
        tcp.setting({tcp.CC_ENV: "vegas"})


def test_a_named_setting_is_taken_as_given_where_the_kernel_lists_none(monkeypatch):
    """A kernel that does not say which congestion controls it has cannot refuse a name: the
    setting is applied, and setsockopt is left to say whether it exists."""
    monkeypatch.setattr(tcp, "available", lambda: [])
    assert tcp.setting({tcp.CC_ENV: "cubic"}) == "cubic"


def test_the_summary_names_what_local_connections_use(monkeypatch):
    monkeypatch.setattr(tcp, "system_default", lambda: "bbr")
    monkeypatch.setattr(tcp, "available", lambda: ["reno", "bbr", "cubic"])
    assert tcp.summary({}) == {"system": "bbr", "local_connections": "reno"}
    assert tcp.summary({tcp.CC_ENV: "keep"}) == {"system": "bbr", "local_connections": "bbr"}
    assert tcp.summary({tcp.CC_ENV: "cubic"}) == {"system": "bbr", "local_connections": "cubic"}
    monkeypatch.setattr(tcp, "system_default", lambda: "cubic")
    assert tcp.summary({}) == {"system": "cubic", "local_connections": "cubic"}


def test_the_summary_of_a_bad_setting_names_what_is_kept(monkeypatch):
    """A setting the kernel does not have is refused, so no connection is changed and they keep the
    system's choice: the summary says so, rather than the reno that auto would have chosen."""
    monkeypatch.setattr(tcp, "system_default", lambda: "bbr")
    monkeypatch.setattr(tcp, "available", lambda: ["reno", "bbr"])
    assert tcp.summary({tcp.CC_ENV: "vegas"}) == {"system": "bbr", "local_connections": "bbr"}


@pytest.fixture
def connection():
    """Both ends of a TCP connection on 127.0.0.1, and a listening socket."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        with client, accepted:
            yield client, accepted, server


def _set_all(socks, name: str) -> None:
    for sock in socks:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
        except (FileNotFoundError, PermissionError) as exc:
            pytest.skip(f"cannot start a connection with {name} here: {exc}")


def test_paced_local_connections_are_switched_once(connection):
    client, accepted, server = connection
    _set_all((client, accepted), "bbr")
    assert tcp.is_local(client) and tcp.is_local(accepted) and not tcp.is_local(server)
    changed = tcp.tune_local_connections({})
    assert changed.get("reno", 0) >= 2  # this test's two ends (and any other paced one)
    assert tcp.congestion_control(client) == tcp.congestion_control(accepted) == "reno"
    assert tcp.tune_local_connections({}) == {}  # nothing paced is left


def test_keep_leaves_them_and_a_name_sets_every_one(connection):
    client, accepted, _ = connection
    _set_all((client, accepted), "bbr")
    assert tcp.tune_local_connections({tcp.CC_ENV: "keep", tcp.NOTSENT_ENV: "keep"}) == {}
    assert tcp.congestion_control(client) == "bbr"
    tcp.tune_local_connections({tcp.CC_ENV: "reno"})
    assert tcp.congestion_control(client) == tcp.congestion_control(accepted) == "reno"


def test_the_unsent_bytes_setting_is_auto_keep_or_a_size():
    assert tcp.notsent_setting({}) == tcp.notsent_setting({tcp.NOTSENT_ENV: "auto"}) == tcp.NOTSENT_AUTO_BYTES
    assert tcp.notsent_setting({tcp.NOTSENT_ENV: " keep "}) is None
    assert tcp.notsent_setting({tcp.NOTSENT_ENV: "64K"}) == 65536
    assert tcp.notsent_setting({tcp.NOTSENT_ENV: "1000"}) == 1000
    assert tcp.notsent_setting({tcp.NOTSENT_ENV: "2147483647"}) == (1 << 31) - 1
    for bad in ("0", "-1", "lots", "1.5M", "2G"):
        with pytest.raises(ValueError, match=r"LOOPBACK_NOTSENT=.* is not auto, keep or a size") as info:
            tcp.notsent_setting({tcp.NOTSENT_ENV: bad})
        assert "\n" not in str(info.value)


def test_the_summary_names_the_unsent_bytes_local_connections_hold(monkeypatch):
    monkeypatch.setattr(tcp, "CAN_LIMIT_NOTSENT", True)
    monkeypatch.setattr(tcp, "_read", lambda name: "4294967295" if name == "tcp_notsent_lowat" else "")
    assert tcp.notsent_summary({}) == {"system": 4294967295, "local_connections": tcp.NOTSENT_AUTO_BYTES}
    unlimited = {"system": 4294967295, "local_connections": 4294967295}
    assert tcp.notsent_summary({tcp.NOTSENT_ENV: "keep"}) == unlimited
    assert tcp.notsent_summary({tcp.NOTSENT_ENV: "1M"})["local_connections"] == 1 << 20
    monkeypatch.setattr(tcp, "_read", lambda name: "")
    assert tcp.notsent_summary({tcp.NOTSENT_ENV: "keep"}) == {"system": None, "local_connections": None}
    monkeypatch.setattr(tcp, "CAN_LIMIT_NOTSENT", False)  # nothing is applied, so nothing is claimed
    assert tcp.notsent_summary({}) == {"system": None, "local_connections": None}


@pytest.mark.skipif(not tcp.CAN_LIMIT_NOTSENT, reason="this platform cannot list and limit connections")
def test_local_connections_get_the_limit_on_unsent_bytes_once(connection):
    client, accepted, server = connection
    kernel = tcp.notsent_lowat(client)
    assert tcp.tune_local_connections({tcp.CC_ENV: "keep", tcp.NOTSENT_ENV: "keep"}) == {}
    assert tcp.notsent_lowat(client) == kernel
    changed = tcp.tune_local_connections({tcp.CC_ENV: "keep"})
    assert changed.get(tcp.NOTSENT, 0) >= 2 and set(changed) == {tcp.NOTSENT}
    assert tcp.notsent_lowat(client) == tcp.notsent_lowat(accepted) == tcp.NOTSENT_AUTO_BYTES != kernel
    assert tcp.tune_local_connections({tcp.CC_ENV: "keep"}) == {}  # each has it already
    tcp.tune_local_connections({tcp.CC_ENV: "keep", tcp.NOTSENT_ENV: "64K"})
    assert tcp.notsent_lowat(client) == tcp.notsent_lowat(accepted) == 65536


def test_the_auto_limit_on_unsent_bytes_is_the_measured_256_kib():
    """256 KiB is the limit docs/PERFORMANCE.md measured ("Unsent bytes on local connections": fewer
    retransmissions, the ring behind builtin less often), against 64 KiB, 512 KiB and 1 MiB."""
    assert tcp.NOTSENT_AUTO_BYTES == 256 * 1024
    assert tcp.notsent_setting({}) == 256 * 1024


class _FakeConnection:
    """A local connection using ``current``, whose congestion control reading or setting raises
    ``read_error`` or ``set_error``."""

    def __init__(self, current: str = "bbr", read_error=None, set_error=None) -> None:
        self.current, self.read_error, self.set_error = current, read_error, set_error
        self.set_to: list[bytes] = []

    def getsockopt(self, level: int, option: int, size: int) -> bytes:
        assert (level, option) == (socket.IPPROTO_TCP, socket.TCP_CONGESTION)
        if self.read_error is not None:
            raise self.read_error
        return self.current.encode().ljust(size, b"\0")

    def setsockopt(self, level: int, option: int, value: bytes) -> None:
        assert (level, option) == (socket.IPPROTO_TCP, socket.TCP_CONGESTION)
        if self.set_error is not None:
            raise self.set_error
        self.set_to.append(value)


def _tune(monkeypatch, fakes: list[_FakeConnection], environ: dict[str, str], notsent: bool) -> dict:
    monkeypatch.setattr(tcp, "CAN_LIMIT_NOTSENT", True)
    monkeypatch.setattr(tcp, "local_connections", lambda: iter(fakes))
    monkeypatch.setattr(tcp, "_limit_notsent", lambda sock, lowat: notsent)
    return tcp.tune_local_connections(environ)


def test_a_connection_closed_while_being_tuned_is_skipped(monkeypatch):
    """A connection gloo closes between being listed and being tuned (EBADF on reading its
    congestion control) is passed over, with the unsent-bytes limit it got counted, and the next
    one is still tuned."""
    closed = _FakeConnection(read_error=OSError(9, "closed"))
    paced = _FakeConnection("bbr")
    assert _tune(monkeypatch, [closed, paced], {}, notsent=True) == {tcp.NOTSENT: 2, "reno": 1}
    assert paced.set_to == [b"reno"]


def test_a_user_not_allowed_the_algorithm_is_told_what_is_allowed(monkeypatch):
    """setsockopt refusing the algorithm to this user (EPERM) is a setting to change, one line naming
    the variable and the kernel's allowed list, not a connection to pass over silently."""
    proc = {"tcp_available_congestion_control": "reno cubic bbr", "tcp_allowed_congestion_control": "reno"}
    monkeypatch.setattr(tcp, "_read", lambda name: proc.get(name, ""))
    refused = _FakeConnection("bbr", set_error=PermissionError(1, "Operation not permitted"))
    with pytest.raises(ValueError, match=r"^\$COMMBENCH_LOOPBACK_CC='cubic': .*\(allowed: reno\)$") as info:
        _tune(monkeypatch, [refused], {tcp.CC_ENV: "cubic"}, notsent=False)
    assert "\n" not in str(info.value)


def test_each_listed_connection_is_closed_once_the_next_is_taken(connection):
    """local_connections hands out duplicates of this process's descriptors: each is closed once
    the caller moves on, so listing them leaves no descriptor behind."""
    client, accepted, _ = connection
    before = len(os.listdir("/proc/self/fd"))
    listed = list(tcp.local_connections())
    assert len(listed) >= 2  # this test's two ends (and any other local one)
    assert all(sock.fileno() == -1 for sock in listed)
    assert len(os.listdir("/proc/self/fd")) == before
    assert client.fileno() != -1 and accepted.fileno() != -1  # the originals are left open


def test_udp_and_other_sockets_are_not_connections_to_tune():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, socket.socket() as unconnected:
        udp.connect(("127.0.0.1", 9))
        assert not tcp.is_local(udp)
        assert not tcp.is_local(unconnected)
    a, b = socket.socketpair()
    with a, b:
        assert not tcp.is_local(a)


def test_a_bad_setting_is_one_line_and_exit_2_before_any_rank_starts(monkeypatch, capsys, no_ranks):
    from commbench.bench import cli

    monkeypatch.setattr(tcp, "available", lambda: ["reno", "cubic"])
    monkeypatch.setenv(tcp.CC_ENV, "vegas")
    code = cli.main(["sweep", "-b", "1K", "-e", "1K", "--world-size", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "COMMBENCH_LOOPBACK_CC='vegas'" in err and "rank" not in err


def test_a_bad_unsent_bytes_setting_is_one_line_and_exit_2(monkeypatch, capsys):
    from commbench.bench import cli

    monkeypatch.setenv(tcp.NOTSENT_ENV, "lots")
    code = cli.main(["sweep", "-b", "1K", "-e", "1K", "--world-size", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "COMMBENCH_LOOPBACK_NOTSENT='lots'" in err
