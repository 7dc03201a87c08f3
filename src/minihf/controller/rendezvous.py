"""The launcher's rendezvous: torch's static one, which says while it waits and why it failed.

``minihf train|sft|rm --nnodes M`` starts one launcher per node; they meet at node 0's
``--rdzv-endpoint HOST:PORT`` (node 0 holds a TCP store there, the others connect to it)
before any rank starts. The launcher silences torch's log lines (the ranks speak for
themselves), so a node whose peer never came printed nothing for 10 minutes and then a C++
stack. ``WaitingRendezvous`` is torch's ``StaticTCPRendezvous`` with two additions: a line
after ``WAIT_NOTE_S`` of waiting (then every ``WAIT_REPEAT_S``) naming whom it waits for,
and a ``RendezvousFailed`` whose one line says which side was missing once the store gives
up (after ``controller.timeout_s``, the job's own timeout). A node other than 0 first waits
in Python until node 0's port accepts connections, so torch's client does not log each
failed try as C++ error lines. It is registered with torch's
rendezvous registry under ``RDZV_BACKEND``: that registry is how the elastic launcher is
handed a rendezvous.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

WAIT_NOTE_S, WAIT_REPEAT_S = 5.0, 60.0  # a node still waiting says so after this, then every
RDZV_BACKEND = "minihf-static"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6::addr]:PORT`` for IPv6) -> (host, port); a ValueError naming the
    fix for an empty host, a port that is not 1..65535, or a host that does not resolve."""
    flag = f"--rdzv-endpoint {endpoint!r}"
    host, colon, port_text = endpoint.strip().rpartition(":")
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not colon or not host or not port_text.isdigit():
        raise ValueError(f"{flag}: give HOST:PORT, node 0's address and a free port there, the same on every "
                         "node (e.g. 10.0.0.1:29500)")
    port = int(port_text)
    if not 1 <= port <= 65535:
        why = " (0 asks the OS for any free port, which the other ranks cannot know)" if port == 0 else ""
        raise ValueError(f"{flag}: port {port} is not a TCP port 1..65535{why}; give node 0's fixed port, "
                         "e.g. 29500")
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"{flag}: host {host!r} does not resolve ({exc}); give node 0's IP address or a "
                         "name every node resolves") from None
    return host, port


class RendezvousFailed(RuntimeError):
    """The nodes did not meet; the message says which side was missing and what to do."""


class WaitingRendezvous(StaticTCPRendezvous):
    """torch's static rendezvous (node 0 holds the TCP store at the endpoint; the others
    connect to it) that says while it waits and why it failed: the launcher silences torch's
    log lines, so a node whose peer never came printed nothing for 10 minutes, then a C++
    stack. Registered as ``RDZV_BACKEND`` (torch's registry is the only way to hand the
    elastic launcher a rendezvous)."""

    @classmethod
    def create(cls, params) -> "WaitingRendezvous":
        host, port = parse_endpoint(params.endpoint)
        return cls(host, port, int(params.config["rank"]), params.max_nodes, params.run_id,
                   float(params.config.get("timeout", 600)))

    def get_backend(self) -> str:
        return RDZV_BACKEND

    def _where(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    def _waiting(self, seconds: float) -> str:
        node = f"node {self.rank} of --nnodes {self.world_size}"
        whom = (f"the other node(s) to join at {self._where()} (each started with --rdzv-endpoint "
                f"{self._where()} and its own --node-rank 1..{self.world_size - 1})" if self.rank == 0
                else f"node 0 at {self._where()} (started there with --node-rank 0)")
        return (f"[minihf] {node}: waiting for {whom}, {seconds:.0f} s so far; gives up after "
                f"controller.timeout_s={self.timeout.total_seconds():g} s")

    def _failed(self, exc: BaseException) -> str:
        limit = f"controller.timeout_s={self.timeout.total_seconds():g} s"
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            if self.rank == 0:
                return (f"the nodes did not meet: node 0 waited {limit} at {self._where()} and not all "
                        f"of --nnodes {self.world_size} joined; start the others with the same --rdzv-endpoint "
                        "(--node-rank 1..), or raise controller.timeout_s")
            return (f"the nodes did not meet: node 0 did not answer at {self._where()} within {limit}; start "
                    "node 0 (--node-rank 0) on that host, and check the address and that the port is open to "
                    "this node")
        return f"the rendezvous at {self._where()} failed on node {self.rank}: {text}"

    def _wait_for_node0(self, deadline: float) -> None:
        """Until node 0's store accepts connections: torch's client would log each failed
        try as C++ error lines (a stack each) before giving up. A bare connection is not a
        client to the store (a client registers itself after connecting)."""
        while True:
            try:
                with socket.create_connection((self.master_addr, self.master_port), timeout=2.0):
                    return
            except OSError:
                if time.monotonic() >= deadline:
                    raise TimeoutError("timed out waiting for node 0's store") from None
                time.sleep(0.5)

    def next_rendezvous(self):
        done = threading.Event()
        start = time.monotonic()

        def note() -> None:
            wait = WAIT_NOTE_S
            while not done.wait(wait):
                print(self._waiting(time.monotonic() - start), file=sys.stderr, flush=True)
                wait = WAIT_REPEAT_S
        threading.Thread(target=note, name="minihf-rdzv-note", daemon=True).start()
        try:
            if self.rank != 0:
                self._wait_for_node0(start + self.timeout.total_seconds())
            return super().next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - torch's store errors: said in one line
            raise RendezvousFailed(self._failed(exc)) from None
        finally:
            done.set()
