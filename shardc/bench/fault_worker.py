"""One process of the fault campaign's training job (:mod:`shardc.bench.faults` launches,
kills and relaunches it): the tiny MLP under ``auto_shard`` on every device of the job, one
batch per step, a checkpoint every ``--every`` steps through
:class:`shardc.runtime.checkpoint.Checkpoints`, resumed from the newest complete one.

    python -m shardc.bench.fault_worker --process-id 0 --processes 2 --port P --devices 4 \\
        --ckpt DIR --plans DIR --steps 300 --every 10 [--stop-at S] [--fault KIND:STEP:VICTIM]

The data loader is :func:`batch_for`: batch ``b`` is a function of ``b`` alone, and the
loader's position (the next batch to read) is saved in each checkpoint's meta and read back
on restore, so a resumed job neither skips nor repeats a batch. Plans come from the plan
cache ``--plans`` (``auto_shard(cache_dir=...)``): a mesh planned for once is never solved
again. ``--stop-at S`` ends the job cleanly after checkpoint ``S`` (the scheduler takes the
job off one host to give it back its second).

Faults (``VICTIM``, a process index, injects it; ``-1``: every process): ``step`` SIGKILL once
step ``STEP`` is dispatched; ``save`` once checkpoint ``STEP``'s save has started; ``sealed``
once checkpoint ``STEP`` is committed and sealed (the campaign then damages it);
``restore`` (``STEP`` 0) SIGKILL from a thread started as the restore begins; ``enospc``
the save of checkpoint ``STEP`` raises ``OSError(ENOSPC)`` (a simulated full disk: the
worker raises it before handing the save to Orbax) and the process exits with
:data:`NO_SPACE`.

Prints one JSON line per event, each with the process index and ``time.time()``:
``ready`` (imports and ``jax.distributed`` done), ``planned`` (seconds, where the plan came
from), ``restored`` (seconds, the step, the loader position), ``step`` (the batch, the loss;
the first with its seconds: compile and run), ``saved``, ``fault``, ``done`` / ``stopped``.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys
import threading
import time
import traceback

from shardc.errors import BenchError

#: the exit status of a process whose checkpoint found no space (sysexits.h's EX_TEMPFAIL:
#: a temporary failure, try again)
NO_SPACE = 75


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m shardc.bench.fault_worker")
    for name in ("process-id", "processes", "port", "devices", "steps", "every"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--plans", required=True)
    p.add_argument("--stop-at", type=int)
    p.add_argument("--fault", default="")
    return p.parse_args(argv)


def _start(a: argparse.Namespace):
    """JAX on this process's CPU devices, joined to the job's other processes."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={a.devices}")
    import jax

    jax.config.update("jax_num_cpu_devices", a.devices)
    if a.processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{a.port}",
                                   num_processes=a.processes, process_id=a.process_id,
                                   initialization_timeout=60)
    return jax


def batch_for(cfg, b: int):
    """The data loader: batch ``b`` (1-based), the same on every run and every process."""
    from shardc.models import mlp

    return mlp.example_batch(cfg, seed=1000 + b)


def budget(state, n_devices: int) -> float:
    """A memory budget that makes the plan split the state (the tiny MLP runs replicated
    otherwise): half of it per device on 8 devices, three quarters on 4."""
    import jax

    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    return state_bytes * (0.5 if n_devices >= 8 else 0.75)


class Job:
    """The training loop of one launch, its fault and its event log."""

    def __init__(self, a: argparse.Namespace, jax):
        kind, at, victim = (a.fault.split(":") + ["", "", ""])[:3] if a.fault else ("", 0, 0)
        self.a, self.jax = a, jax
        self.fault = (kind, int(at or 0)) if int(victim or 0) in (-1, a.process_id) else None

    def say(self, event: str, **fields) -> None:
        line = json.dumps({"event": event, "process": self.a.process_id, "t": time.time(),
                           **fields}) + "\n"
        sys.stdout.flush()  # one write of the whole line: gloo writes to the same file
        os.write(sys.stdout.fileno(), line.encode())

    def hit(self, kind: str, at: int = 0) -> bool:
        """Whether this process injects fault ``kind`` at ``at`` now (logged first)."""
        if self.fault != (kind, at):
            return False
        self.say("fault", kind=kind, at=at)
        return True

    def plan(self, cfg, abstract, abstract_batch):
        import shardc

        jax, t = self.jax, time.perf_counter()
        n = len(jax.devices())
        mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        step = shardc.auto_shard(_step_fn(cfg), mesh=mesh, memory_budget=budget(abstract, n),
                                 cache_dir=self.a.plans)
        plan = step.plan(abstract, abstract_batch)
        source = "cache" if "cached" in plan.solver else "solved"
        self.say("planned", s=time.perf_counter() - t, source=source, devices=n)
        return step, plan

    def restore(self, ckpt, abstract, state_sh):
        """The newest complete checkpoint's state and loader position, else (None, 1)."""
        t = time.perf_counter()
        if ckpt.all_steps() and self.hit("restore"):
            threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGKILL)).start()
        found = ckpt.restore_newest(abstract, state_sh)
        if found is None:
            self.say("restored", s=time.perf_counter() - t, step=0, next_batch=1)
            return None, 0, 1
        if found.meta.get("next_batch") != found.step + 1:
            raise BenchError(f"checkpoint {found.step} holds loader position "
                             f"{found.meta.get('next_batch')}, not {found.step + 1}")
        self.say("restored", s=time.perf_counter() - t, step=found.step,
                 next_batch=found.meta["next_batch"])
        return found.state, found.step, found.meta["next_batch"]

    def save(self, ckpt, i: int, state, plan, next_batch: int) -> None:
        if self.hit("enospc", i):
            raise OSError(errno.ENOSPC, f"No space left on device writing checkpoint {i} "
                          f"in {ckpt.directory}")
        ckpt.save(i, state, plan, meta={"next_batch": next_batch})
        if self.hit("save", i):
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.wait()
        self.say("saved", step=i)
        if self.hit("sealed", i):
            os.kill(os.getpid(), signal.SIGKILL)


def _step_fn(cfg):
    from shardc.models import mlp

    return mlp.build_step(cfg)


def train(job: Job) -> int:
    """Run the job from its newest complete checkpoint to its end; the last step run."""
    import numpy as np

    from shardc.models import mlp
    from shardc.runtime.checkpoint import Checkpoints
    from shardc.runtime.multihost import global_batch, process_slice

    a, jax = job.a, job.jax
    cfg = mlp.MLPConfig.tiny()
    abstract = jax.eval_shape(lambda: mlp.init_state(cfg))  # made only when starting afresh
    abstract_batch = jax.eval_shape(lambda: batch_for(cfg, 1))
    step, plan = job.plan(cfg, abstract, abstract_batch)
    (state_sh, batch_sh), _ = step.input_shardings(abstract, abstract_batch)
    ckpt = Checkpoints(a.ckpt, max_to_keep=3)
    state, start, next_batch = job.restore(ckpt, abstract, state_sh)
    if state is None:
        state = jax.tree.map(np.asarray, mlp.init_state(cfg))
    end = min(a.steps, a.stop_at or a.steps)
    for i in range(start + 1, end + 1):
        t, b = time.perf_counter(), next_batch
        full = batch_for(cfg, b)
        local = {k: np.asarray(v)[process_slice(batch_sh[k], v.shape)] for k, v in full.items()}
        state, loss = step(state, global_batch(local, batch_sh,
                                               {k: v.shape for k, v in full.items()}))
        next_batch += 1
        if job.hit("step", i):
            os.kill(os.getpid(), signal.SIGKILL)
        loss = float(loss)
        job.say("step", step=i, batch=b, loss=loss,
                **({"s": time.perf_counter() - t} if i == start + 1 else {}))
        if i % a.every == 0 or i == end:
            job.save(ckpt, i, state, plan, next_batch)
    ckpt.close()
    return end


def main(argv: list[str]) -> None:
    a = _args(argv)
    jax = _start(a)
    import shardc.models.mlp  # noqa: F401  (imported before "ready": a restart's start cost)
    import shardc.runtime.checkpoint  # noqa: F401

    job = Job(a, jax)
    job.say("ready", devices=len(jax.devices()))
    try:
        end = train(job)
    except BaseException as exc:  # exit now: the other processes may wait in a collective
        full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC
        print(f"fault_worker: {exc}; exiting so that the job restarts from its newest "
              "complete checkpoint once space is freed" if full else
              traceback.format_exc(), file=sys.stderr, flush=True)
        os._exit(NO_SPACE if full else 1)
    job.say("done" if end == a.steps else "stopped", step=end)
    if a.processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
