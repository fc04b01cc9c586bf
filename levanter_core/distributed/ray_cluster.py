"""Ray for a training run: the processes of a multi-process run start or join a Ray cluster
(``trainer.ray``) so that tokenizing the data caches spreads over every training host.

Every process of a run enters :func:`ray_for_run` right after ``jax.distributed`` starts and
stays in it for the whole run. What happens depends on ``trainer.ray`` and on the number of
processes:

* one process: nothing is started. ``address`` None tokenizes with local worker processes;
  ``local``, ``auto`` and ``host:port`` connect when the first cache is built.
* several processes, no ``address``, ``auto_start_cluster`` (the default): process 0 starts a
  Ray head on its host, the others join it as worker nodes (``start_workers``), and process 0
  tokenizes on that cluster. The cluster is private to the run: its nodes accept only a
  token that process 0 makes up and hands to the others.
* several processes and an ``address``: with ``start_workers`` every process joins that
  cluster as a worker node (``auto`` joins ``RAY_ADDRESS`` if set, else the machines are
  taken to be members already; ``local`` joins nothing: process 0 starts a private Ray).
* several processes, no ``address``, ``auto_start_cluster: false``: no Ray; process 0
  tokenizes with local worker processes.

Ray is an optional dependency (the core's ``ray`` extra). Without it on process 0's host, a
multi-process run with no ``address`` tokenizes without Ray, as with ``auto_start_cluster:
false``, and logs that it does; an ``address`` (which asks for Ray) stops the run before
training with a :class:`~levanter_core.errors.ConfigError` saying what to install.

A node is a ``ray start --block`` child process of the training process; it stops its
node's processes when it ends and is ended, on exit or error, by the process that started
it (never with ``ray stop``, which would stop every Ray of the machine, other users'
included). It also dies with that process (a kill included): start it from the thread that
lives for the run, the main thread, since Linux ties the child to the starting thread.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

from levanter_core import distributed
from levanter_core.errors import ConfigError, LevanterError

logger = logging.getLogger(__name__)

NODE_START_TIMEOUT_S = 180
"""How long ``ray start`` may take to bring a node up."""
NODE_STOP_GRACE_S = 30
"""How long a node may take to stop its processes after SIGTERM before it is killed."""
FINISH_TIMEOUT_S = 10 * 60
"""How long a process waits at the end of the run for the others before it stops its node."""

# Run before `ray start`: ask Linux to kill the node if the training process's starting
# thread dies (killed included), then become `ray start`. Ray itself ties the node's own
# processes to `ray start` the same way.
_TIED_TO_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)  # the parent died before the line above\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'ray.scripts.scripts', 'start', *sys.argv[2:]])\n"
)
_STARTED = "Ray runtime started"  # what `ray start` prints once its node is up


class RayNodeError(LevanterError):
    """A Ray node of the run could not start."""


class RayNode:
    """A Ray node this process started: a ``ray start --block`` child process whose output
    is kept (the last lines) for error messages."""

    def __init__(self, role: str, args: list[str], env: dict[str, str], *, port: int | None = None):
        self.role = role
        self.port = port  # a head's
        self.command = "ray start " + " ".join(args)
        self._lines: collections.deque[str] = collections.deque(maxlen=60)
        self._up = threading.Event()
        self.process = subprocess.Popen(
            [sys.executable, "-c", _TIED_TO_PARENT, str(os.getpid()), "--block", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        # Read all the output, always: a full pipe would block the node.
        self._reader = threading.Thread(target=self._read, name=f"ray {role} output", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self) -> None:
        assert self.process.stdout is not None  # stdout=PIPE
        for line in self.process.stdout:
            self._lines.append(line.rstrip())
            if _STARTED in line:
                self._up.set()

    def output(self) -> str:
        return "\n".join(self._lines)

    def wait_up(self, timeout_s: float) -> None:
        """Return once the node is up; raise :class:`RayNodeError` (with ``ray start``'s
        output) if it exits first or takes longer than ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self._up.wait(0.2):
            code = self.process.poll()
            if code is not None or time.monotonic() > deadline:
                self.stop()
                self._reader.join(5)  # the last lines, which say why
                why = f"exited with status {code}" if code is not None else f"was not up after {timeout_s:.0f}s"
                raise RayNodeError(
                    f"trainer.ray: the Ray {self.role} node of process {distributed.process_index()} could not "
                    f"start: `{self.command}` {why}. Its output:\n{self.output()}\n"
                    "To start no node, set trainer.ray.auto_start_cluster: false (no Ray: local tokenizer "
                    "processes) or, with an address, trainer.ray.start_workers: false."
                )

    def stop(self) -> None:
        """End the node: SIGTERM (``ray start`` then stops its processes), SIGKILL if it
        does not end within :data:`NODE_STOP_GRACE_S`."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(NODE_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                logger.warning("the Ray %s node (pid %d) did not stop; killing it", self.role, self.pid)
                self.process.kill()
                self.process.wait()
        if self.port is not None:
            _forget_head(self.port)
        logger.info("stopped the Ray %s node (pid %d)", self.role, self.pid)


def _forget_head(port: int) -> None:
    """Remove the note ``ray start --head`` left of its address on this machine (as ``ray
    stop`` would), if it still names our head: ``ray.init()`` would try to join the stopped
    head for minutes."""
    try:
        from ray._common.utils import get_ray_address_file
    except ImportError:  # no Ray here (its node could not have started): no note to remove
        return

    path = get_ray_address_file(None)
    try:
        with open(path) as f:
            if f.read().strip().endswith(f":{port}"):
                os.remove(path)
    except OSError:
        pass  # no note, or another one's


INSTALL_RAY = "pip install 'levanter-core[ray]'"


def ray_installed() -> bool:
    """Whether Ray can be imported in this environment (the core's ``ray`` extra)."""
    try:
        return importlib.util.find_spec("ray") is not None
    except ImportError:  # an import hook that refuses it, or a broken parent package
        return False


def require_ray(config) -> None:
    """Raise :class:`ConfigError` naming ``trainer.ray.address`` if ``config`` (a ``RayConfig``)
    asks for a Ray cluster and Ray is not installed: without this the first cache build
    would stop the run with an import error."""
    if config.address is not None and not ray_installed():
        raise ConfigError(
            f"trainer.ray.address is {config.address!r}, but Ray is not installed: {INSTALL_RAY}, or unset "
            "trainer.ray.address to tokenize without Ray (with local processes, on process 0)"
        )


def check_reachable(address: str, *, timeout_s: float = 10.0) -> None:
    """Raise :class:`ConfigError` naming ``trainer.ray.address`` unless something answers at
    ``address`` (``host:port``): Ray itself retries an unreachable address for minutes."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"trainer.ray.address: {address!r} is not host:port, 'auto' or 'local'; give the address "
            "`ray start --head` printed (e.g. 10.0.0.1:6379)"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(
            f"trainer.ray.address: no Ray cluster answers at {address!r} ({e}). Check the head's host and "
            "port, or unset the address to tokenize with local processes (or, in a multi-process run, on a "
            "cluster the training hosts start themselves)."
        ) from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _start_node(role: str, args: list[str], env: dict[str, str], *, port: int | None = None) -> RayNode:
    """Start a Ray node with ``ray start ARGS`` and wait until it is up. Every port a node
    listens on is chosen free, so several nodes (and other users' Ray) can share a host."""
    args = [*args, "--disable-usage-stats", f"--dashboard-agent-listen-port={_free_port()}"]
    node = RayNode(role, args, env, port=port)
    node.wait_up(NODE_START_TIMEOUT_S)
    logger.info("started a Ray %s node (pid %d): %s", role, node.pid, node.command)
    return node


def _auth_env(token: str) -> dict[str, str]:
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set, restored on exit (the Ray client of this process
    reads its authentication token from there)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _start_run_cluster(config, nodes: list[RayNode]) -> tuple[str, dict[str, str]]:
    """The cluster of an ``auto_start_cluster`` run: process 0 starts the head and shares its
    address and token; the others join as workers if ``start_workers``. Returns the head's
    address and the environment that authenticates with it."""
    if distributed.is_leader():
        token = secrets.token_hex(32)
        host, port = distributed.coordinator_host(), _free_port()
        assert host is not None, "a run of several processes has a coordinator"  # (only they start a cluster)
        address = f"{host}:{port}"
        try:
            head = [
                "--head",
                f"--port={port}",
                f"--node-ip-address={socket.gethostbyname(host)}",
                "--include-dashboard=false",
                f"--dashboard-port={_free_port()}",
                f"--ray-client-server-port={_free_port()}",
            ]
            nodes.append(_start_node("head", head, {**os.environ, **_auth_env(token)}, port=port))
        except BaseException as e:
            distributed.share("ray/cluster", json.dumps({"error": str(e)}))  # so the others stop waiting
            raise
        distributed.share("ray/cluster", json.dumps({"address": address, "token": token}))
    else:
        cluster = json.loads(distributed.share("ray/cluster"))
        if "error" in cluster:
            raise RayNodeError(f"trainer.ray: process 0 could not start the run's Ray head:\n{cluster['error']}")
        address, token = cluster["address"], cluster["token"]
        if config.start_workers:
            nodes.append(_start_node("worker", [f"--address={address}"], {**os.environ, **_auth_env(token)}))
    return address, _auth_env(token)


def _join_address(address: str) -> str | None:
    """The cluster a training host joins as a worker for ``trainer.ray.address``; None when
    there is nothing to join (``local``, or ``auto`` on a machine that is already a member)."""
    if address == "local":
        return None
    if address == "auto":
        return os.environ.get("RAY_ADDRESS") or None
    return address


def _disconnect() -> None:
    """End this process's Ray client (and a private ``local`` Ray), if Ray was used."""
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()


def _wait_for_everyone() -> None:
    """Wait until every process is done with the cluster, so no node stops under a task."""
    try:
        distributed.barrier("ray/finished", timeout_s=FINISH_TIMEOUT_S)
    except Exception as e:  # another process failed or is stuck: stop this process's node anyway
        logger.warning("stopping the Ray node without waiting for the other processes: %s", e)


def _stop_all(nodes: list[RayNode]) -> None:
    for node in reversed(nodes):  # the head last
        node.stop()


def _role(config, multi: bool) -> str | None:
    """What the training hosts do with Ray: ``"start"`` their own cluster, ``"join"`` the
    one ``address`` names, or None (nothing: a single process, or Ray off). The same in every
    process of a run, so all of them meet at the same barriers."""
    if not multi:
        return None
    if config.address is None:
        return "start" if config.auto_start_cluster else None
    return "join" if config.start_workers else None


def _leader_has_ray() -> bool:
    """Whether Ray is installed on process 0's host, in every process: process 0 decides
    whether the run starts a cluster, so that all of them meet at the same barriers."""
    return distributed.share("ray/installed", str(ray_installed()) if distributed.is_leader() else None) == "True"


@contextlib.contextmanager
def ray_for_run(config, tokenizes: Callable[[], bool] | None = None) -> Iterator:
    """Start or join the run's Ray cluster as ``config`` (a ``RayConfig``) says; yield the
    ``RayConfig`` the data pipeline uses (``address`` set to the run's own cluster when the
    hosts started one). Call it in every process, from the main thread, after
    ``jax.distributed`` started; on exit (normal or error) the nodes this process started are
    stopped and its Ray client disconnected.

    ``tokenizes``: asked in process 0 only, and only when a cluster would be started or joined;
    False (every cache is already built, as when a run resumes) means no cluster is needed, and
    none is started or joined."""
    require_ray(config)
    role = _role(config, distributed.process_count() > 1)
    if role and tokenizes is not None:
        needed = distributed.share("ray/tokenizes", str(tokenizes()) if distributed.is_leader() else None)
        if needed != "True":
            if distributed.is_leader():
                logger.info("every cache is built: no Ray cluster is started or joined")
            role = None
    if role == "start" and not _leader_has_ray():
        role = None
        if distributed.is_leader():
            logger.warning(
                "Ray is not installed (%s), so no Ray cluster is started over the %d processes: process 0 "
                "tokenizes with local processes (trainer.ray.auto_start_cluster: false does the same, quietly)",
                INSTALL_RAY,
                distributed.process_count(),
            )
    connected_before = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    nodes: list[RayNode] = []
    with contextlib.ExitStack() as stack:
        stack.callback(_stop_all, nodes)
        if not connected_before:
            stack.callback(_disconnect)
        effective = config
        if role == "start":
            address, auth = _start_run_cluster(config, nodes)
            stack.enter_context(_environment(auth))
            effective = config.model_copy(update={"address": address})
        elif role == "join" and (join := _join_address(config.address)):
            check_reachable(join)
            nodes.append(_start_node("worker", [f"--address={join}"], dict(os.environ)))
        if role:
            distributed.barrier("ray/joined", timeout_s=2 * NODE_START_TIMEOUT_S)
            if distributed.is_leader():
                logger.info("tokenizing on the Ray cluster at %s", effective.address)
        yield effective
        if role:
            if not connected_before:
                _disconnect()  # before the others stop their nodes
            _wait_for_everyone()
