"""Several hosts, one model: JAX's multi-controller runtime (`jax.distributed`), one process per
host, one global mesh, and a watch that ends every process when one of them is lost.

Mesh order: the global 'tp' axis lists process 0's devices, then process 1's, and so on (each
process's own in id order), so rank r of the pairwise tree all-reduce (sharding/tree_allreduce.py)
is the same device in every process and the tree adds the same blocks in the same order as on
one host: with 2 processes x 4 devices, ((d0 + d1) + (d2 + d3)) + ((d4 + d5) + (d6 + d7)), the
last add crossing the hosts. TP 8 over two hosts performs exactly TP 8's (and TP 1's) additions.

Why a watch beside JAX's own heartbeats: a process that dies inside a collective leaves its peers
waiting in the collective, and JAX's coordination service only notices after its heartbeat
timeout, then aborts with a message that names no process. Each follower keeps one TCP
connection to process 0 (authenticated by a token shared through the first collective); the
kernel closes it the moment a process dies, and the peer's watch thread then ends its own process
at once with `EXIT_PEER_LOST` and an error naming the lost process. JAX's heartbeat timeout
(`heartbeat_timeout`) remains the backstop for a host that vanishes without closing its sockets
(TCP keep-alive probes are on as well). The same connection carries process 0's request stream to
the followers when serving (serving/engine/multihost.py).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import queue
import secrets
import socket
import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger("jdet.distributed")

EXIT_PEER_LOST = 75  # process exit status when another process of the mesh is lost
ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_HELLO = struct.Struct("!i16s")  # a follower's first bytes: its process id and the job's token
_FRAME = struct.Struct("!cQ")  # frame kind, payload length
_MESSAGE, _BYE, _FAIL = b"M", b"B", b"F"  # a message; a clean exit; an exit on an error


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """Where this process sits in a multi-process job (validated; from settings or env)."""

    num_processes: int
    process_id: int
    coordinator_address: str

    @property
    def coordinator_host(self) -> str:
        host = self.coordinator_address.rsplit(":", 1)[0]
        return host[1:-1] if host.startswith("[") else host


def resolve(
    num_processes: int | None = None,
    process_id: int | None = None,
    coordinator_address: str | None = None,
    env: dict | None = None,
) -> ProcessSpec | None:
    """The job this process belongs to, or None for a single process. Unset values are read from
    JAX_NUM_PROCESSES, JAX_PROCESS_ID and JAX_COORDINATOR_ADDRESS (the names JAX and its
    launchers use); one process (the default) needs none of them."""
    env = os.environ if env is None else env
    n = num_processes if num_processes not in (None, 1) else _env_int(env, "JAX_NUM_PROCESSES")
    if n is None or n == 1:
        return None
    pid = process_id if process_id is not None else _env_int(env, "JAX_PROCESS_ID")
    addr = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"num_processes must be a positive integer, got {n!r}")
    if pid is None or not isinstance(pid, int) or not 0 <= pid < n:
        raise ValueError(
            f"num_processes={n} needs this process's id in [0, {n}): give --process-id "
            f"(or JAX_PROCESS_ID), got {pid!r}"
        )
    if not addr or ":" not in addr:
        raise ValueError(
            f"num_processes={n} needs the coordinator's host:port (process 0's host): give "
            f"--coordinator-address (or JAX_COORDINATOR_ADDRESS), got {addr!r}"
        )
    return ProcessSpec(n, pid, addr)


def _env_int(env: Any, name: str) -> int | None:
    v = env.get(name)
    if v in (None, ""):
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"${name}={v!r} is not an integer") from None


class Cluster:
    """This process's membership of a running multi-process job: its id, the peers' watch, and
    (process 0 -> followers) a stream of messages in order."""

    def __init__(self, spec: ProcessSpec, conns: dict[int, socket.socket]) -> None:
        self.spec = spec
        self.process_id = spec.process_id
        self.num_processes = spec.num_processes
        self.is_leader = spec.process_id == 0
        self._conns = conns  # process 0: follower id -> socket; a follower: {0: socket}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._closing = False
        self._departed: set[int] = set()
        self._send_lock = threading.Lock()
        self._failure: str | None = None  # the uncaught exception this process ends with
        for pid, conn in conns.items():
            threading.Thread(
                target=self._watch, args=(pid, conn), name=f"jdet-watch-{pid}", daemon=True
            ).start()
        # A process that ends on an error tells its peers so (they exit, naming it) rather than
        # saying goodbye: they would otherwise wait for it in their next collective.
        previous = sys.excepthook

        def record_failure(kind: type, value: BaseException, tb: Any) -> None:
            self._failure = f"{kind.__name__}: {value}"[:1000]
            previous(kind, value, tb)

        sys.excepthook = record_failure
        atexit.register(self.close)

    # -- process 0 -> followers ---------------------------------------------------------------
    def broadcast(self, payload: bytes) -> None:
        """Process 0: send one message to every follower (they receive them in order)."""
        if not self.is_leader:
            raise RuntimeError("only process 0 broadcasts")
        frame = _FRAME.pack(_MESSAGE, len(payload)) + payload
        with self._send_lock:
            for pid, conn in self._conns.items():
                try:
                    conn.sendall(frame)
                except OSError as e:
                    self._lost(pid, f"sending to it failed ({e})")

    def receive(self) -> bytes | None:
        """A follower: the next message from process 0 (blocks); None once process 0 left."""
        return self._inbox.get()

    # -- the watch ----------------------------------------------------------------------------
    def _watch(self, pid: int, conn: socket.socket) -> None:
        """Read frames from `pid` until it says goodbye; a closed connection means it died."""
        try:
            while True:
                head = _recv_exact(conn, _FRAME.size)
                if head is None:
                    break
                kind, n = _FRAME.unpack(head)
                if kind == _BYE:
                    self._departed.add(pid)
                    self._inbox.put(None)  # a follower waiting for process 0's next message
                    return
                body = _recv_exact(conn, n)
                if body is None:
                    break
                if kind == _FAIL:
                    self._lost(pid, f"it failed: {body.decode(errors='replace')}")
                    return
                self._inbox.put(body)
            reason = "its connection closed"
        except OSError as e:
            reason = f"its connection failed ({e})"
        if not self._closing and pid not in self._departed:
            self._lost(pid, reason)

    def _lost(self, pid: int, reason: str) -> None:
        if self._closing or pid in self._departed:
            return
        msg = (
            f"jdet: lost process {pid} of {self.num_processes} ({reason}): the model is split "
            f"over every process, so process {self.process_id} cannot go on; exiting with status "
            f"{EXIT_PEER_LOST}. Restart all processes together."
        )
        print(msg, file=sys.stderr, flush=True)  # not through logging: it may be silenced
        self._exit_process(EXIT_PEER_LOST)

    def _exit_process(self, status: int) -> None:
        os._exit(status)  # at once, from any thread, even while the main one is in a collective

    def close(self) -> None:
        """Leave the job: peers see a goodbye (or, after an uncaught exception, the error), not
        a lost connection. Idempotent; runs at exit."""
        if self._closing:
            return
        self._closing = True
        if self._failure is None:
            frame = _FRAME.pack(_BYE, 0)
        else:
            why = self._failure.encode()
            frame = _FRAME.pack(_FAIL, len(why)) + why
        with self._send_lock:
            for conn in self._conns.values():
                try:
                    conn.sendall(frame)
                    conn.shutdown(socket.SHUT_WR)
                except OSError:
                    pass


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _keepalive(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt, val in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            s.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)


_CLUSTER: Cluster | None = None


def current() -> Cluster | None:
    """The job this process joined (`initialize`), or None when it runs alone."""
    return _CLUSTER


def initialize(spec: ProcessSpec | None, *, heartbeat_timeout: int = 10,
               init_timeout: int = 120) -> Cluster | None:  # fmt: skip
    """Join the job `spec` describes (None: stay a single process) and return its `Cluster`.

    Call it before anything touches a JAX device (loading a model does): `jax.distributed` must
    start before the backend. Joining again with the same spec returns the same Cluster; with
    another spec it is an error. Every process of the job must call it."""
    global _CLUSTER
    if spec is None:
        return None
    if _CLUSTER is not None:
        if _CLUSTER.spec != spec:
            raise ValueError(f"this process already joined {_CLUSTER.spec}, not {spec}")
        return _CLUSTER
    try:
        jax.distributed.initialize(
            spec.coordinator_address, spec.num_processes, spec.process_id,
            initialization_timeout=init_timeout, heartbeat_timeout_seconds=heartbeat_timeout,
        )  # fmt: skip
    except RuntimeError as e:
        raise RuntimeError(
            f"{e} -- start the multi-process job (num_processes/process_id/coordinator_address, "
            "or jdet.distributed.initialize) before loading the model or using any JAX device"
        ) from e
    _CLUSTER = Cluster(spec, _connect(spec, init_timeout))
    return _CLUSTER


def _connect(spec: ProcessSpec, timeout: float) -> dict[int, socket.socket]:
    """Process 0 listens on an ephemeral port; the port and a random token reach the followers
    through one collective (so only members of this JAX job learn them); each follower connects
    and identifies itself."""
    server = None
    info = np.zeros(5, np.int32)
    if spec.process_id == 0:
        server = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True) \
            if socket.has_dualstack_ipv6() else socket.create_server(("", 0))  # fmt: skip
        info[0] = server.getsockname()[1]
        info[1:] = np.frombuffer(secrets.token_bytes(16), np.int32)
    info = np.asarray(multihost_utils.broadcast_one_to_all(info))
    port, token = int(info[0]), info[1:].astype(np.int32).tobytes()
    if server is None:
        conn = socket.create_connection((spec.coordinator_host, port), timeout=timeout)
        conn.settimeout(None)
        _keepalive(conn)
        conn.sendall(_HELLO.pack(spec.process_id, token))
        return {0: conn}
    conns: dict[int, socket.socket] = {}
    server.settimeout(timeout)
    try:
        while len(conns) < spec.num_processes - 1:
            conn, _ = server.accept()
            conn.settimeout(timeout)
            hello = _recv_exact(conn, _HELLO.size)
            if hello is None:
                conn.close()
                continue
            pid, their = _HELLO.unpack(hello)
            if not secrets.compare_digest(their, token) or not 0 < pid < spec.num_processes \
                    or pid in conns:  # fmt: skip
                conn.close()  # not a member of this job
                continue
            conn.settimeout(None)
            _keepalive(conn)
            conns[pid] = conn
    except TimeoutError:
        missing = sorted(set(range(1, spec.num_processes)) - set(conns))
        raise RuntimeError(
            f"processes {missing} did not connect to process 0 within {timeout} s"
        ) from None
    finally:
        server.close()
    return conns


def mesh_devices() -> list[Any]:
    """The devices a mesh is cut from: this process's own when it runs alone; in a
    multi-process job every process's, process 0's first (the module docstring says why)."""
    if jax.process_count() == 1:
        return list(jax.local_devices())
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def check_spans_processes(tp: int) -> None:
    """In a multi-process job the 'tp' mesh must hold every device of every process: a process
    with no device in the mesh would have nothing to run and no outputs to read."""
    n = jax.device_count()
    if jax.process_count() > 1 and tp != n:
        raise ValueError(
            f"tp={tp} but the {jax.process_count()} processes hold {n} devices together; in a "
            f"multi-process job the model is split over all of them: use tp={n}"
        )


def same_everywhere(digest: bytes) -> bool:
    """Whether every process holds the same `digest` (e.g. a hash of its inputs; one
    collective)."""
    mine = np.frombuffer(digest, np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine))
    return bool((every == mine).all())


def agree_min(value: int) -> int:
    """The smallest of every process's `value` (one collective), e.g. a memory-derived size."""
    every = multihost_utils.process_allgather(np.asarray([value], np.int32))
    return int(np.asarray(every).min())


def broadcast_u32(values: Sequence[int]) -> list[int]:
    """Process 0's unsigned 32-bit integers (e.g. seeds) on every process (one collective)."""
    arr = np.asarray(values, np.uint32).reshape(-1)
    if arr.size == 0:
        return []
    return [int(x) for x in np.asarray(multihost_utils.broadcast_one_to_all(arr))]
