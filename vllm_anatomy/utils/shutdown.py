"""Stop child processes: the one shutdown sequence of the engine client and the executor.

Mirrors vllm/v1/utils.py (`shutdown(procs, timeout)`, vLLM's process manager).
Both owners of child processes use it: the multi-process engine client (its
EngineCoreProc) and MultiprocExecutor (its workers). Each then unlinks the
shared memory its children could not (segments are named after the owner's
ipc directory, vllm_anatomy.executor.shm_broadcast.unlink_shm_segments).
"""
from __future__ import annotations

import logging
import time
from multiprocessing.process import BaseProcess

logger = logging.getLogger(__name__)


def shutdown(procs: list[BaseProcess], *, exit_wait_s: float = 0.0, terminate_wait_s: float) -> None:
    """Wait up to `exit_wait_s` for `procs` to exit on their own, SIGTERM those still
    alive and wait up to `terminate_wait_s`, then SIGKILL the rest; reap every one.

    terminate_wait_s == 0: SIGKILL at once.
    NOTE: join() is what reaps a child: one never joined stays a zombie in the
    process table for as long as this process lives.
    """
    deadline = time.monotonic() + exit_wait_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    alive = [proc for proc in procs if proc.is_alive()]
    if terminate_wait_s > 0:
        for proc in alive:
            proc.terminate()
        deadline = time.monotonic() + terminate_wait_s
        for proc in alive:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in alive:
        if proc.is_alive():
            if terminate_wait_s > 0:
                logger.warning("%s did not exit %.0f s after SIGTERM: SIGKILL.", proc.name, terminate_wait_s)
            proc.kill()
        proc.join()
