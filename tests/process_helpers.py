"""Run worker processes in a test without ever leaving one behind."""

from __future__ import annotations


def run_to_end(procs, timeout_s: float) -> list:
    """Start ``procs``, wait up to ``timeout_s`` each, kill any still running; their exit codes.

    A worker left alive (one stuck on a barrier after a sibling failed, say) would make the
    interpreter wait for it at exit, and the whole test run would hang instead of failing.
    """
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    return [p.exitcode for p in procs]
