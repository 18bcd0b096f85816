"""Run a function on a gloo world of forked processes and collect each rank's result.

Forking costs ~0.1 s per world (spawn costs ~3 s per rank on 2 cores), so tests can afford many
small worlds. Each rank runs with one intra-op thread. Results are pickled in the child and
returned in rank order; an exception on any rank is re-raised in the parent with its traceback
(as :class:`RankAssertionError`, an ``AssertionError``, when the rank's check failed), and a world
that does not finish within ``timeout`` is killed and reported.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import random
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# Ports for test worlds: below Linux's ephemeral range (32768-60999), so no socket the kernel
# numbers for gloo takes one between ``free_port`` and the store's bind, and one slice per
# pytest-xdist worker (PYTEST_XDIST_WORKER gw0, gw1, ...), so two workers never pick the same.
PORTS = range(20000, 32000)
PORTS_PER_WORKER = 3000


def _port_range() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not worker[2:].isdigit():
        return PORTS
    first = PORTS.start + (int(worker[2:]) * PORTS_PER_WORKER) % len(PORTS)
    return range(first, first + PORTS_PER_WORKER)


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (see ``PORTS``)."""
    ports = _port_range()
    for _ in range(100):
        port = random.SystemRandom().randrange(ports.start, ports.stop)  # leaves random's state
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or in TIME_WAIT after an earlier world
                continue
            return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1} after 100 tries")


def _is_check(e: BaseException) -> bool:
    """Whether ``e`` is a test's check failing (``assert``, ``torch.testing.assert_close``,
    ``pytest.fail``/``pytest.raises``' "DID NOT RAISE"), not a crash."""
    failed = type(e).__name__ == "Failed" and type(e).__module__.startswith("_pytest")
    return isinstance(e, AssertionError) or failed


def _child(fn, rank, world, port, conn, collective_timeout, init, args, kwargs) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            OMP_NUM_THREADS="1",
        )
        if init:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=collective_timeout),
            )
        result = fn(rank, world, *args, **kwargs)
        conn.send((rank, True, pickle.dumps(result)))  # synchronous: done before we exit
    except BaseException as e:  # noqa: BLE001 - everything must reach the parent
        kind = (type(e).__name__, _is_check(e), time.time())
        conn.send((rank, False, (traceback.format_exc(), kind)))
        code = 1
    finally:
        # No destroy_process_group: _exit skips interpreter finalization, so no thread left
        # running can abort the rank, while joining gloo threads after a test ran torch's
        # profiler over their ops can (their thread-exit cleanup finds a corrupted heap).
        os._exit(code)


DIED = "exited without a result (killed or crashed)"


class WorldError(RuntimeError):
    """A rank of a test world raised, died, or the world timed out; ``errors`` maps each
    failed rank to its traceback or how it died, ``root_type`` names what the first failed
    rank raised (``"died"`` for a rank that exited without a word, ``"timeout"`` for a hang)."""

    def __init__(self, message: str, errors: dict[int, str] | None = None, root_type: str = ""):
        super().__init__(message)
        self.errors = errors or {}
        self.root_type = root_type


class RankAssertionError(WorldError, AssertionError):
    """The first failed rank raised an ``AssertionError``: a test's check failed there (not a
    crash), so pytest and ``tools/mutants.py`` see an assertion."""


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    collective_timeout: float = 60.0,
    init: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked gloo ranks
    (``fn.prepare_in_parent(world_size, *args, **kwargs)``, where ``fn`` has it, runs first in
    this process: what every rank would do alike, done once and inherited).

    Returns the per-rank return values in rank order. With ``init=False`` the ranks get
    torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) but no process group:
    ``fn`` starts it, as the entry point does.
    """
    prepare = getattr(fn, "prepare_in_parent", None)
    if prepare is not None:  # work every rank would repeat, done once before the fork
        prepare(world_size, *args, **kwargs)
    ctx = mp.get_context("fork")
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world_size, port, pipes[r][1], collective_timeout, init, args, kwargs),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for _, child_end in pipes:
        child_end.close()  # so a dead child shows up as EOF
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    # rank -> (its exception's type, whether a check failed, when it was raised)
    kinds: dict[int, tuple[str, bool, float]] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    waiting = {pipes[r][0]: r for r in range(world_size)}
    try:
        while waiting:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                break
            ready = mp_connection.wait(list(waiting), timeout=min(left, 1.0))
            if not ready:
                if all(not p.is_alive() for p in procs):
                    break
                continue
            conn = ready[0]
            try:
                rank, ok, payload = conn.recv()
            except EOFError:  # the rank died without a word; its peers are likely blocked
                rank = waiting.pop(conn)
                errors[rank], kinds[rank] = DIED, ("died", False, time.time())
                deadline = min(deadline, datetime.datetime.now() + datetime.timedelta(seconds=5))
                continue
            waiting.pop(conn)
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                errors[rank], kinds[rank] = payload
                # One failed rank usually leaves the others blocked in a collective.
                deadline = min(deadline, datetime.datetime.now() + datetime.timedelta(seconds=5))
    finally:
        for p in procs:
            p.join(timeout=0.5 if errors else 5)
            if p.is_alive():
                p.kill()
                p.join()
    for rank, error in errors.items():
        code = procs[rank].exitcode
        if error == DIED and code is not None and code < 0:
            errors[rank] = f"killed by signal {-code} before returning a result"
    if errors:
        # The rank that raised first: the others usually fail because of it (a peer gone from
        # a collective), and their reports can reach this process in either order.
        first = min(errors, key=lambda r: kinds[r][2])
        root, assertion, _ = kinds[first]
        error_type = RankAssertionError if assertion else WorldError
        raise error_type(f"rank {first} of {world_size} failed:\n{errors[first]}", errors, root)
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        message = f"world of {world_size} timed out after {timeout}s; ranks {missing} hung"
        raise WorldError(message, root_type="timeout")
    return [results[r] for r in range(world_size)]
