"""How a flagdeploy process shares the CPU's cores with the cpu backend's kernel pool (its own threads,
backends/cpu/csrc/thread_pool.h, beside OpenMP's that torch's ops run on). Both settings are taken only where
the user has not made them.

- On many cores OpenMP's idle threads sleep at once (`sleep_idle_openmp`). By default libgomp's threads spin for
  milliseconds after each parallel region; a prompt's layers alternate torch's matmuls and the backend's kernels,
  so the two pools' spinning threads fight over the cores. On a 16-core Xeon a first token after 50-170 prompt
  tokens took 0.23-0.88 s, 0.13-0.26 s with them sleeping; on the 2-core EPYC sleeping cost more in wake-ups than it
  freed (AVX2 build, one stream over HTTP 134-153 tok/s against 186 spinning; docs/performance.md, issue 54's
  sixteenth pass), so it is left as it was below `PASSIVE_MIN_CORES`. libgomp reads the policy once, when torch
  loads it: it is set before torch is imported, or not at all.
- Under `flagdeploy serve` the kernels leave cores to the server's own threads (`threads_for_server`): the HTTP
  event loop and the engine's Python run while the step's loops spin on every core they were given, and a pool
  thread that loses its core holds up the loop's end for all the others.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

_WAIT_POLICY = "OMP_WAIT_POLICY"
PASSIVE_MIN_CORES = 8  # measured at 2 (spinning better) and 16 (sleeping better) cores only
_set_here = False  # whether this process set OMP_WAIT_POLICY (so that `user_environ` leaves it out)


def sleep_idle_openmp() -> bool:
    """Make OpenMP's idle threads sleep at once (OMP_WAIT_POLICY=PASSIVE) on a host of `PASSIVE_MIN_CORES` or more,
    where torch is not loaded yet and the user chose no policy (OMP_WAIT_POLICY, GOMP_SPINCOUNT). Returns whether it
    was set here."""
    global _set_here
    if {_WAIT_POLICY, "GOMP_SPINCOUNT"} & os.environ.keys() or cores() < PASSIVE_MIN_CORES:
        return False
    if "torch" in sys.modules:
        log.debug("OpenMP's wait policy left as it is: torch is loaded already")
        return False
    os.environ[_WAIT_POLICY] = "PASSIVE"
    _set_here = True
    log.debug("OpenMP's idle threads sleep at once (OMP_WAIT_POLICY=PASSIVE)")
    return True


def user_environ() -> dict[str, str]:
    """The environment as the user gave it, for a process that is not flagdeploy's (llama-server, an external
    engine): without the OpenMP policy set here."""
    return {k: v for k, v in os.environ.items() if not (_set_here and k == _WAIT_POLICY)}


def cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))  # taskset's, cgroups' cpusets
    except AttributeError:
        return os.cpu_count() or 1


def threads_for_server(chip: str | None) -> int | None:
    """Set and return the kernels' threads for a server process on `chip`'s backend (its `server_threads` of
    this process's cores), or None where OMP_NUM_THREADS says how many or the backend has no such rule."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    from flagdeploy import ops

    backend = ops.get_backend(chip) if chip else ops.detect_backend()
    if backend.server_threads is None:
        return None
    import torch

    have = cores()
    n = backend.server_threads(have)
    torch.set_num_threads(n)
    log.info("%s backend: %d kernel threads, %d of %d cores left to the server", backend.name, n, have - n, have)
    return n
