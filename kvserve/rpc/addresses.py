"""Service addresses that name several replicas: a host name resolving to several addresses (a
Kubernetes headless Service, a Compose service scaled to N) is that many replicas."""

from __future__ import annotations

import socket


def resolve(target: str) -> list[tuple[str, str | None]]:
    """`host:port` -> every address it names, as (`ip:port`, the host name to check a TLS certificate
    against, or None for an address given as such). `localhost` stays one replica; a name that does not
    resolve (yet) names none. ValueError when `target` is not HOST:PORT."""
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {target!r} is not HOST:PORT")
    host = host.strip("[]")
    if host == "localhost":
        return [(target, None)]
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        return [(target, None)]
    except OSError:
        pass
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError:
        return []
    addrs = {(f"[{i[4][0]}]" if i[0] == socket.AF_INET6 else str(i[4][0])) + f":{port}" for i in infos}
    return [(a, host) for a in sorted(addrs)]


class Targets:
    """Addresses that may name several replicas each, resolved on demand. A name that resolves to
    nothing (DNS down for a moment, a Service between pods) keeps the addresses it last had, so a
    resolver hiccup never drops every replica; it starts with none."""

    def __init__(self, targets: list[str]) -> None:
        self.targets = targets
        self._last: dict[str, list[tuple[str, str | None]]] = {}

    def resolve(self) -> dict[str, str | None]:
        """Every address, with the host name to check its certificate against (None: as given)."""
        out: dict[str, str | None] = {}
        for target in self.targets:
            found = resolve(target) or self._last.get(target, [])
            self._last[target] = found
            out.update(found)
        return out


def split_targets(text: str) -> list[str]:
    """'a:1, b:2' -> ['a:1', 'b:2']; ValueError for an empty list or an entry that is not HOST:PORT."""
    targets = [t.strip() for t in text.split(",") if t.strip()]
    if not targets:
        raise ValueError("no address given")
    for t in targets:
        host, _, port = t.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"address {t!r} is not HOST:PORT")
    return targets
