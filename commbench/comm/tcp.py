"""How gloo's connections between ranks on one host are tuned: congestion control and unsent bytes.

A connection whose two ends are on one host runs over the loopback device, where there is no
link to share and no queue to keep short. A pacing congestion control (BBR) still spaces the
segments out to the bandwidth it estimates, and on a busy host that estimate is of the CPU: on
the 2-core CI-class VM, whose kernel default is BBR, the same 4-rank allreduces ran faster on
every such connection switched to Reno, gloo's own and the ring alike (docs/PERFORMANCE.md,
"Loopback and congestion control").

So, by default, every connected TCP socket of this process whose peer is on this host and whose
congestion control paces is switched to Reno, which does not pace and which the kernel lets
every user pick. Connections to other hosts keep the system's choice. ``$COMMBENCH_LOOPBACK_CC``
changes this: ``keep`` leaves every connection as the system made it (for comparison), and the
name of an available algorithm (``cubic``, ``bbr``, ...) sets it on every local connection.

The same local connections also get a limit on the bytes a socket holds that have not been sent
yet (``TCP_NOTSENT_LOWAT``, :data:`NOTSENT_AUTO_BYTES`): gloo writes without blocking, and a socket
that takes no more than this leaves the rest of a message in gloo's buffer until the kernel has
sent what it holds. On the 2-core VM, 4-rank sweeps from 1 to 64 MiB retransmitted fewer TCP
segments with it, and the ring fell behind builtin less often at 32 and 64 MiB (docs/PERFORMANCE.md,
"Unsent bytes on local connections"). ``$COMMBENCH_LOOPBACK_NOTSENT`` changes this: ``keep``
leaves the kernel's limit (none, unless set system-wide), and a size (``64K``, ``1M``) sets that.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterator

from commbench.units import AmbiguousSize, parse_size

CC_ENV = "COMMBENCH_LOOPBACK_CC"
AUTO, KEEP = "auto", "keep"
UNPACED = "reno"  # built into every Linux kernel, and allowed to unprivileged users
PACING = ("bbr",)  # name prefixes of congestion controls that pace (bbr, bbr2, bbr3)
_PROC = "/proc/sys/net/ipv4"

NOTSENT_ENV = "COMMBENCH_LOOPBACK_NOTSENT"
NOTSENT_AUTO_BYTES = 256 << 10
NOTSENT_MAX_BYTES = (1 << 31) - 1  # the option is a C int
NOTSENT = "notsent_lowat"  # the key counting connections given the limit (tune_local_connections)
# Connections are found through /proc/self/fd (Linux), and the option is Linux's and macOS's.
CAN_LIMIT_NOTSENT = hasattr(socket, "TCP_NOTSENT_LOWAT") and os.path.isdir("/proc/self/fd")


def _read(name: str) -> str:
    try:
        with open(os.path.join(_PROC, name)) as f:
            return f.read().strip()
    except OSError:
        return ""


def available() -> list[str]:
    """Congestion controls this kernel has loaded (empty where it does not say)."""
    return _read("tcp_available_congestion_control").split()


def system_default() -> str | None:
    """The congestion control new connections get (None where the kernel does not say)."""
    return _read("tcp_congestion_control") or None


def paces(name: str | None) -> bool:
    return name is not None and name.startswith(PACING)


def setting(environ: dict[str, str] | None = None) -> str:
    """``$COMMBENCH_LOOPBACK_CC``, checked: ``auto`` (unset), ``keep`` or an available name.

    Raises:
        ValueError: a name this kernel does not have (one line, listing those it has).
    """
    value = (os.environ if environ is None else environ).get(CC_ENV, "").strip() or AUTO
    if value in (AUTO, KEEP):
        return value
    have = available()
    if have and value not in have:
        raise ValueError(
            f"${CC_ENV}={value!r} is not a congestion control this kernel has; "
            f"choose {AUTO}, {KEEP} or one of: {', '.join(have)}"
        )
    return value


def notsent_setting(environ: dict[str, str] | None = None) -> int | None:
    """``$COMMBENCH_LOOPBACK_NOTSENT``, checked: the unsent bytes a local connection may hold
    (:data:`NOTSENT_AUTO_BYTES` when unset or ``auto``), or None for ``keep``.

    Raises:
        ValueError: neither ``auto``, ``keep`` nor a size from one byte to 2 GiB - 1 (one line).
    """
    value = (os.environ if environ is None else environ).get(NOTSENT_ENV, "").strip() or AUTO
    if value == AUTO:
        return NOTSENT_AUTO_BYTES
    if value == KEEP:
        return None
    try:
        size = parse_size(value)
    except AmbiguousSize as error:
        raise ValueError(f"${NOTSENT_ENV}={value!r} is {error}") from None
    except ValueError:
        size = 0
    if not 1 <= size <= NOTSENT_MAX_BYTES:
        raise ValueError(
            f"${NOTSENT_ENV}={value!r} is not {AUTO}, {KEEP} or a size in bytes under 2G (e.g. 256K, 1M)"
        )
    return size


def local_choice(current: str | None, chosen: str) -> str | None:
    """What a local connection now using ``current`` should use under ``chosen`` (None: leave it)."""
    if chosen == KEEP:
        return None
    if chosen == AUTO:
        return UNPACED if paces(current) else None
    return None if chosen == current else chosen


def summary(environ: dict[str, str] | None = None) -> dict[str, str | None]:
    """The system's congestion control and what local connections use under the setting."""
    default = system_default()
    try:
        chosen = setting(environ)
    except ValueError:
        chosen = KEEP
    return {"system": default, "local_connections": local_choice(default, chosen) or default}


def notsent_summary(environ: dict[str, str] | None = None) -> dict[str, int | None]:
    """The system's limit on unsent bytes (None where the kernel does not say) and what local
    connections hold under the setting."""
    text = _read("tcp_notsent_lowat")
    default = int(text) if text.isdigit() else None
    try:
        chosen = notsent_setting(environ)
    except ValueError:
        chosen = None
    if not CAN_LIMIT_NOTSENT:
        chosen = None
    return {"system": default, "local_connections": default if chosen is None else chosen}


def _host_of(address) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(address[0].split("%")[0])
    except (ValueError, IndexError, TypeError, AttributeError):
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def same_host(me, peer) -> bool:
    """Whether a connection between socket addresses ``me`` and ``peer`` stays on this host."""
    mine, theirs = _host_of(me), _host_of(peer)
    return theirs is not None and (theirs.is_loopback or theirs == mine)


def is_local(sock: socket.socket) -> bool:
    """Whether ``sock`` is a connected TCP socket whose peer is on this host."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return False
    try:
        return same_host(sock.getsockname(), sock.getpeername())
    except OSError:  # not connected (a listening socket)
        return False


def congestion_control(sock: socket.socket) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()


def _sockets() -> Iterator[socket.socket]:
    """A duplicate of each of this process's sockets (the caller closes each)."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            dup = os.dup(fd)
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        yield sock


def local_connections() -> Iterator[socket.socket]:
    """A duplicate of each connected TCP socket of this process whose peer is on this host;
    each is closed when the next is taken."""
    for sock in _sockets():
        with sock:
            if is_local(sock):
                yield sock


def notsent_lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)


def _limit_notsent(sock: socket.socket, lowat: int) -> bool:
    """Give ``sock`` the limit on unsent bytes; whether it changed (False: it had it, or is closed)."""
    try:
        if notsent_lowat(sock) == lowat:
            return False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, lowat)
    except OSError:
        return False
    return True


def tune_local_connections(environ: dict[str, str] | None = None) -> dict[str, int]:
    """Apply both settings to every local TCP connection of this process; return how many
    connections were changed, by the congestion control each now uses and, under
    :data:`NOTSENT`, how many got the limit on unsent bytes. Idempotent."""
    chosen = setting(environ)
    lowat = notsent_setting(environ) if CAN_LIMIT_NOTSENT else None
    changed: dict[str, int] = {}
    if chosen == KEEP or not hasattr(socket, "TCP_CONGESTION"):
        chosen = None
    if chosen is None and lowat is None:
        return changed
    for sock in local_connections():
        if lowat is not None and _limit_notsent(sock, lowat):
            changed[NOTSENT] = changed.get(NOTSENT, 0) + 1
        try:
            new = None if chosen is None else local_choice(congestion_control(sock), chosen)
        except OSError:  # closed meanwhile
            continue
        if new is None:
            continue
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, new.encode())
        except PermissionError:
            allowed = _read("tcp_allowed_congestion_control")
            raise ValueError(
                f"${CC_ENV}={new!r}: this user may not choose it (allowed: {allowed or 'unknown'})"
            ) from None
        except OSError:  # closed meanwhile
            continue
        changed[new] = changed.get(new, 0) + 1
    return changed
