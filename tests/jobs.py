"""Launching multi-process jobs for the tests: every process a subprocess of this
interpreter, on a free localhost port, with a time limit (a hung job fails its test)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Ended:
    """How one process ended: its exit code, the JSON lines it printed, its stderr tail."""

    code: int
    events: list
    stderr: str

    @property
    def last(self) -> dict | None:
        return self.events[-1] if self.events else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, argv: list[list[str]], timeout: float = 150) -> list[Ended]:
    """Run ``tests/<script>`` once per entry of ``argv`` (that process's arguments; the
    string ``{port}`` becomes the job's port) and wait for every process."""
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": ""}
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", script),
                               *(a.replace("{port}", port) for a in args)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in argv]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
            out.append(Ended(p.returncode, events, stderr[-3000:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out
