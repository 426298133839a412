"""The fault campaign (``shardc bench --faults``): a training job on 2 processes x 4 CPU
devices (:mod:`shardc.bench.fault_worker`) run by a supervisor that, like a cluster
scheduler, relaunches it whenever a process dies, while faults are injected at seeded
random points: a process SIGKILLed mid-step, mid-save and mid-restore; a host lost (the job
goes on on 1 x 4 devices, re-planned, until the host returns); the newest checkpoint
truncated or a file of it deleted; a disk full during a save. An uninterrupted run of the
same job is the reference its losses are compared with.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shardc.errors import BenchError, OptionsError

__all__ = ["CAMPAIGN", "EVERY", "KINDS", "Fault", "campaign", "checks", "markdown", "schedule",
           "summary", "write"]

#: fault kinds, and the worker's fault each injects (``shardc.bench.fault_worker``)
KINDS = {"kill-step": "step", "kill-save": "save", "kill-restore": "restore",
         "host-lost": "step", "truncated": "sealed", "deleted": "sealed", "enospc": "enospc"}
#: kinds injected at a checkpoint (their step is a multiple of the interval)
AT_SAVE = {"kill-save", "truncated", "deleted", "enospc"}
#: kinds every process injects (a whole job stops after a checkpoint; a full disk fails
#: every process's save); the others hit one process, which the supervisor sees die
EVERY_PROCESS = {"truncated", "deleted", "enospc"}
#: kinds held back while a host is lost: one of two hosts lost; one process of two killed
#: mid-restore (the other left waiting in the restore)
TWO_PROCESSES = {"host-lost", "kill-restore"}
#: ``shardc bench --faults``: 32 faults, every kind at least 4 times (a fault set back past
#: the job's end by the ones before it is never injected: a margin over 30)
CAMPAIGN = {"kill-step": 6, "kill-save": 5, "kill-restore": 5, "host-lost": 4,
            "truncated": 4, "deleted": 4, "enospc": 4}
EVERY = 10  # the campaign's checkpoint interval, in steps
DEVICES = 4  # CPU devices per process
LAUNCH_TIMEOUT_S = 240  # a launch that hangs longer fails the campaign
GRACE_S = 1.0  # how long the other processes get once one has died, before SIGKILL


@dataclass
class Fault:
    """One injected fault and what it cost: the step the job had reached, the checkpoint
    the job resumed from, and the phases of the restart that followed."""

    kind: str
    at: int
    victim: int = 0
    launch: int = -1
    reached: int = -1
    resumed_from: int = -1
    recovery: dict = field(default_factory=dict)

    @property
    def lost(self) -> int:
        return self.reached - self.resumed_from


def schedule(seed: int, counts: dict[str, int], steps: int, every: int) -> list[Fault]:
    """``counts[kind]`` faults of each kind in a seeded random order at increasing seeded
    random steps after the second checkpoint (those at a checkpoint rounded up to one; none
    in the last interval).

    Args:
        seed: the random generator's seed.
        counts: how many faults of each kind (keys of :data:`KINDS`).
        steps: the job's length; every: its checkpoint interval.

    Returns:
        The faults in the order they are injected.

    Raises:
        ValueError: the faults do not fit in the steps.
    """
    rng = random.Random(seed)
    kinds = [k for k, n in counts.items() for _ in range(n)]
    rng.shuffle(kinds)
    if kinds[0] == "kill-restore":  # the first launch has no checkpoint to restore
        kinds.append(kinds.pop(0))
    points = sorted(rng.sample(range(2 * every + 1, steps - every), len(kinds)))
    out, last = [], 0
    for kind, point in zip(kinds, points):
        at = 0 if kind == "kill-restore" else max(point, last + 1)
        if kind in AT_SAVE:
            at = -(-at // every) * every
        if at >= steps:
            raise OptionsError(f"{len(kinds)} faults do not fit in {steps} steps every {every}")
        out.append(Fault(kind, at, rng.randrange(2)))
        last = at or last
    return out


def _newest(ckpt: Path) -> int:
    """The newest sealed checkpoint's step (0: none)."""
    sealed = [int(d.name) for d in ckpt.glob("*") if d.name.isdigit()
              and (d / "shardc-seal.json").exists()]
    return max(sealed, default=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(work: Path, n: int, processes: int, fault: str, stop_at: int | None,
            steps: int, every: int, ckpt: Path) -> dict:
    """Run the job once on ``processes`` processes; kill the others once one dies."""
    port, logs = _free_port(), work / f"launch{n:03d}"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    started, procs = time.time(), []
    for i in range(processes):
        cmd = [sys.executable, "-m", "shardc.bench.fault_worker", "--process-id", str(i),
               "--processes", str(processes), "--port", str(port), "--devices",
               str(DEVICES), "--ckpt", str(ckpt), "--plans", str(work.parent / "plans"),
               "--steps", str(steps), "--every", str(every)]
        cmd += ["--fault", fault] if fault else []
        cmd += ["--stop-at", str(stop_at)] if stop_at else []
        with open(logs / f"p{i}.out", "w") as out, open(logs / f"p{i}.err", "w") as err:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env))
    codes = _reap(procs, started)
    events = [e for i in range(processes) for e in _events((logs / f"p{i}.out").read_text())]
    return {"launch": n, "processes": processes, "fault": fault, "stop_at": stop_at,
            "started": started, "codes": codes, "events": events}


def _events(text: str) -> list[dict]:
    """The worker's JSON events in its standard output, where gloo's own lines may run
    into them; a line cut short by a kill is left out."""
    decoder, out = json.JSONDecoder(), []
    for line in text.splitlines():
        at = line.find('{"event"')
        try:
            out += [decoder.raw_decode(line, at)[0]] if at >= 0 else []
        except ValueError:
            continue
    return out


def _reap(procs: list[subprocess.Popen], started: float) -> list[int]:
    """Every process's exit code; once one fails, the others are killed after GRACE_S (a
    survivor would wait on the dead one's collectives until a timeout)."""
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.time()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now - started > LAUNCH_TIMEOUT_S or (failed_at and now - failed_at > GRACE_S):
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
        time.sleep(0.05)
    return [p.wait() for p in procs]


def _first(events: list[dict], name: str, process: int = 0) -> dict | None:
    return next((e for e in events if e["event"] == name and e["process"] == process), None)


def _phases(launch: dict) -> dict | None:
    """Restart to first step, split: process start (interpreter, JAX, jax.distributed,
    imports), plan (and where it came from), restore, compile (the first step: compile and
    run); None when the launch ran no step."""
    ev = launch["events"]
    ready, planned, restored = (_first(ev, n) for n in ("ready", "planned", "restored"))
    first = _first(ev, "step")
    if first is None or "s" not in first:
        return None
    return {"start": ready["t"] - launch["started"], "plan": planned["s"],
            "plan_source": planned["source"], "restore": restored["s"], "compile": first["s"],
            "total": first["t"] - launch["started"], "devices": planned["devices"]}


def _reached(launch: dict, fault: Fault) -> int:
    """The step a faulted launch had reached: the fault's, or the newest it ran; for a kill
    mid-restore, -1 until the next launch says which checkpoint it restored (its own
    target: a restore trains nothing)."""
    ran = [e["step"] for e in launch["events"] if e["event"] == "step"]
    return -1 if fault.kind == "kill-restore" else max([fault.at, *ran])


def _spec(fault: Fault, processes: int, newest: int, every: int) -> str:
    """The worker's ``--fault`` for ``fault`` on this launch; its step moved past the
    newest checkpoint when an earlier fault set the job back beyond it."""
    if fault.at and fault.at <= newest:
        fault.at = newest + (every if fault.kind in AT_SAVE else 1 + fault.at % every)
    victim = -1 if fault.kind in EVERY_PROCESS else (1 if fault.kind == "host-lost" else
                                                    fault.victim % processes)
    fault.victim = victim
    return f"{KINDS[fault.kind]}:{fault.at}:{victim}"


def _damage(ckpt: Path, fault: Fault) -> str:
    """Truncate the largest file of checkpoint ``fault.at`` to half, or delete it."""
    root = ckpt / str(fault.at)
    files = [p for p in root.rglob("*") if p.is_file() and p.name != "shardc-seal.json"]
    victim = max(files, key=lambda p: (p.stat().st_size, str(p)))
    if fault.kind == "truncated":
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    else:
        victim.unlink()
    return str(victim.relative_to(ckpt))


def campaign(work: str | os.PathLike, faults: list[Fault], steps: int, every: int,
             return_after: int = 2, reference: bool = True, say=print) -> dict:
    """Run the job to its end under ``faults`` (in order), relaunching it after each, and
    (``reference``) an uninterrupted run of it on 2 processes.

    Args:
        work: a folder for the checkpoints, the plan cache and every launch's logs.
        faults: what to inject, in order (:func:`schedule`).
        steps: the job's length; every: its checkpoint interval.
        return_after: a lost host returns once the job has saved this many intervals
            without it.
        reference: whether to run the uninterrupted reference too.
        say: where progress lines go.

    Returns:
        The launches (each with its events), the faults fired (with their costs), those
        never reached, the reference launch (or None) and the wall time.

    Raises:
        RuntimeError: the job has not finished after twice as many launches as faults.
    """
    work = Path(work)
    ckpt, t0 = work / "faulted" / "ckpt", time.time()
    launches, pending, fired, processes, back_at = [], list(faults), [], 2, 0
    while not launches or not _finished(launches[-1]):
        if len(launches) > 2 * len(faults) + 10:
            raise BenchError(f"the job has not finished after {len(launches)} launches; "
                             f"see the logs under {work / 'faulted'}")
        newest = _newest(ckpt)
        if processes == 1 and newest >= back_at:
            processes = 2  # the host is back
        fault = pending[0] if pending and (processes == 2 or
                                           pending[0].kind not in TWO_PROCESSES) else None
        spec = _spec(fault, processes, newest, every) if fault else ""
        stop = back_at if processes == 1 else None
        if fault and stop and fault.at > stop:
            fault, spec = None, ""
        launch = _launch(work / "faulted", len(launches), processes, spec, stop, steps,
                         every, ckpt)
        launch["resume_point"] = newest
        launches.append(launch)
        _resumed(fired, launch)
        if fault and any(e["event"] == "fault" for e in launch["events"]):
            fired.append(pending.pop(0))
            if _record(fault, launch, ckpt):
                processes = 1
                back_at = min(steps, (-(-fault.at // every) + return_after) * every)
        say(f"launch {launch['launch']}: {processes} process(es), fault {spec or 'none'}, "
            f"exit {launch['codes']}, {time.time() - t0:.0f} s")
    if reference:
        say("the uninterrupted reference run ...")
        reference = _launch(work / "reference", 0, 2, "", None, steps, every,
                            work / "reference" / "ckpt")
    return {"steps": steps, "every": every, "devices": DEVICES, "faults": fired,
            "unfired": pending, "launches": launches, "reference": reference or None,
            "wall_s": time.time() - t0}


def _record(fault: Fault, launch: dict, ckpt: Path) -> bool:
    """Note where ``fault`` hit, damage the checkpoint it names; whether a host is lost."""
    fault.launch, fault.reached = launch["launch"], _reached(launch, fault)
    if fault.kind in ("truncated", "deleted"):
        launch["damaged"] = _damage(ckpt, fault)
    if fault.kind == "kill-restore":  # killed before any process finished restoring
        launch["mid_restore"] = not any(e["event"] == "restored" for e in launch["events"])
    return fault.kind == "host-lost"


def _finished(launch: dict) -> bool:
    return all(c == 0 for c in launch["codes"]) and \
        _first(launch["events"], "done") is not None


def _resumed(fired: list[Fault], launch: dict) -> None:
    """Give the faults before ``launch`` the checkpoint it restored and its phases."""
    restored = _first(launch["events"], "restored")
    if restored is None:
        return
    for f in fired:
        if f.resumed_from < 0 and f.launch < launch["launch"]:
            f.resumed_from, f.recovery = restored["step"], _phases(launch) or {}
            f.reached = restored["step"] if f.kind == "kill-restore" else f.reached


def _losses(launch: dict) -> dict[int, dict]:
    return {e["step"]: e for e in launch["events"] if e["event"] == "step" and
            e["process"] == 0}


def checks(result: dict, reference: dict[int, float] | None = None) -> dict:
    """What the run shows: every step applied once in the lineage that finished, each with
    its own batch, each launch going on from the step it restored, and the losses against
    the reference's (``reference``, else the reference run's): bit-equal until the first
    step run on another device count, within a relative difference after it.

    Raises:
        AssertionError: a step missing, repeated, skipped or fed another batch.
    """
    lineage: dict[int, dict] = {}
    for launch in result["launches"]:
        ran = _losses(launch)
        restored = _first(launch["events"], "restored")
        start = restored["step"] if restored else None
        if ran and list(ran) != list(range(start + 1, start + 1 + len(ran))):
            raise AssertionError(f"launch {launch['launch']} restored {start} but ran "
                                 f"steps {list(ran)}")
        for i, e in ran.items():
            lineage[i] = {**e, "devices": launch["processes"] * DEVICES}
    steps = result["steps"]
    if sorted(lineage) != list(range(1, steps + 1)):
        raise AssertionError(f"steps missing from the lineage: "
                             f"{sorted(set(range(1, steps + 1)) - set(lineage))}")
    wrong = [i for i, e in lineage.items() if e["batch"] != i]
    if wrong:
        raise AssertionError(f"steps fed another batch than their own: {wrong[:5]}")
    ref = reference or {i: e["loss"] for i, e in _losses(result["reference"]).items()}
    replanned = min((i for i, e in lineage.items() if e["devices"] != 2 * DEVICES),
                    default=steps + 1)
    same = [i for i in range(1, replanned) if lineage[i]["loss"] == ref[i]]
    rel = [abs(lineage[i]["loss"] - ref[i]) / abs(ref[i]) for i in range(replanned, steps + 1)]
    return {"steps_checked": steps, "first_replanned_step": replanned,
            "bit_equal": len(same), "bit_equal_of": replanned - 1,
            "after_replan": len(rel), "max_rel_diff_after_replan": max(rel, default=0.0),
            "bit_equal_after_replan": sum(r == 0 for r in rel),
            "final_loss": lineage[steps]["loss"], "reference_final_loss": ref[steps],
            "losses": {i: [e["loss"], ref[i], e["devices"]] for i, e in lineage.items()}}


def summary(result: dict) -> dict:
    """Per fault kind of :func:`campaign`'s ``result``: how many, survived, steps lost
    (max, mean), recovery seconds per phase (means) and where the plans came from.

    Args:
        result: what :func:`campaign` returned.

    Returns:
        ``{kind: {"injected", "survived", "lost_max", "lost_mean", "start_s", "plan_s",
        "restore_s", "compile_s", "total_s", "plans"}}``.
    """
    out = {}
    for kind in KINDS:
        fs = [f for f in result["faults"] if f.kind == kind]
        if not fs:
            continue
        rec = [f.recovery for f in fs if f.recovery]
        out[kind] = {
            "injected": len(fs), "survived": sum(f.resumed_from >= 0 for f in fs),
            "lost_max": max(f.lost for f in fs), "lost_mean": sum(f.lost for f in fs) / len(fs),
            **{f"{p}_s": sum(r[p] for r in rec) / len(rec) if rec else None
               for p in ("start", "plan", "restore", "compile", "total")},
            "plans": sorted({f"{r['plan_source']} ({r['devices']} devices)" for r in rec})}
    return out


def _launch_row(launch: dict) -> dict:
    """A launch without its events: what ran, how it ended, how it restarted."""
    ran = sorted(_losses(launch))
    restored = _first(launch["events"], "restored")
    return {k: launch.get(k) for k in ("launch", "processes", "fault", "stop_at", "codes",
                                       "resume_point", "damaged", "mid_restore")} | {
        "restored": restored["step"] if restored else None,
        "steps": [ran[0], ran[-1]] if ran else None, "phases": _phases(launch)}


def write(result: dict, out: Path, command: str, seed: int) -> list[Path]:
    """Write ``faults.json`` (the raw figures) and ``faults.md`` (the report).

    Args:
        result: what :func:`campaign` returned.
        out: the folder (created if missing).
        command: the command line that made it; seed: the schedule's seed.

    Returns:
        The two paths written.
    """
    out.mkdir(parents=True, exist_ok=True)
    data = {"command": command, "seed": seed, "steps": result["steps"],
            "every": result["every"], "devices_per_process": DEVICES,
            "wall_s": result["wall_s"], "summary": summary(result),
            "checks": checks(result),
            "faults": [asdict(f) | {"lost": f.lost} for f in result["faults"]],
            "unfired": [asdict(f) for f in result["unfired"]],
            "launches": [_launch_row(x) for x in result["launches"]]}
    (out / "faults.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "faults.md").write_text(markdown(data))
    return [out / "faults.json", out / "faults.md"]


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _mid_restore(data: dict) -> str:
    hits = [x["mid_restore"] for x in data["launches"] if x.get("mid_restore") is not None]
    return f"{sum(hits)}/{len(hits)}"


def markdown(data: dict) -> str:
    """The report of a campaign's figures.

    Args:
        data: the figures :func:`write` puts in ``faults.json``.

    Returns:
        The Markdown text.
    """
    c, faults = data["checks"], data["faults"]
    survived = sum(f["resumed_from"] >= 0 for f in faults)
    lines = [
        "# Fault campaign", "",
        f"Made by `{data['command']}` (seed {data['seed']}); written by "
        "`shardc.bench.faults`, raw figures in `faults.json`.", "",
        f"The tiny MLP (`shardc.models.mlp`, `MLPConfig.tiny()`) trained for {data['steps']} "
        f"steps on 2 processes x {data['devices_per_process']} CPU devices "
        "(`jax.distributed`, gloo), a checkpoint every "
        f"{data['every']} steps (`shardc.runtime.checkpoint.Checkpoints`), relaunched by a "
        "supervisor after every fault. "
        f"**Survived {survived}/{len(faults)} faults**; the job finished in "
        f"{len(data['launches'])} launches, {data['wall_s'] / 60:.1f} minutes "
        "(reference run included).", "",
        "## By kind", "",
        "Steps lost: the step the job had reached minus the checkpoint it resumed from. "
        "Recovery: means, in seconds, over the launch that restarted after each fault: "
        "process start (interpreter, JAX, `jax.distributed`, imports), plan (from the plan "
        "cache unless said), restore, compile (the first step: compile and run), and launch "
        "to first step in all.", "",
        f"At most {max(f['lost'] for f in faults)} steps lost to a fault, against a "
        f"checkpoint interval of {data['every']}. Kills mid-restore that landed before any "
        f"process had finished restoring: {_mid_restore(data)}.", "",
        "| kind | injected | survived | steps lost (max / mean) | start | plan | restore "
        "| compile | to first step | plans |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for kind, k in data["summary"].items():
        lines.append(
            f"| {kind} | {k['injected']} | {k['survived']} | {k['lost_max']} / "
            f"{k['lost_mean']:.1f} | {_s(k['start_s'])} | {_s(k['plan_s'])} | "
            f"{_s(k['restore_s'])} | {_s(k['compile_s'])} | {_s(k['total_s'])} | "
            f"{', '.join(k['plans'])} |")
    lines += [
        "", "## Losses against the uninterrupted run", "",
        f"Every step 1..{c['steps_checked']} applied once in the lineage that finished, "
        "each with its own batch (the loader's position is saved in each checkpoint), each "
        "launch going on from the step it restored.", "",
        f"- steps 1..{c['first_replanned_step'] - 1} (before the first step on 1 x 4 "
        f"devices): **{c['bit_equal']}/{c['bit_equal_of']} losses bit-equal** to the "
        "uninterrupted run's",
        f"- steps {c['first_replanned_step']}..{c['steps_checked']} ({c['after_replan']} "
        "steps, a lineage re-planned for 1 x 4 devices and back): "
        f"{c['bit_equal_after_replan']} bit-equal, largest relative difference "
        f"{c['max_rel_diff_after_replan']:.2e}",
        f"- final loss {c['final_loss']!r}, uninterrupted {c['reference_final_loss']!r}",
        "", "Every 25th step (the devices its last run had):", "",
        "| step | loss | uninterrupted | devices |", "|---:|---:|---:|---:|",
        *(f"| {i} | {v[0]!r} | {v[1]!r} | {v[2]} |" for i, v in
          sorted((int(k), v) for k, v in c["losses"].items()) if i % 25 == 0),
        "", "## Every fault", "",
        "| # | kind | step | victim | reached | resumed from | lost | to first step (s) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for i, f in enumerate(faults, 1):
        victim = "all" if f["victim"] < 0 else f"process {f['victim']}"
        lines.append(f"| {i} | {f['kind']} | {f['at'] or '-'} | {victim} | {f['reached']} | "
                     f"{f['resumed_from']} | {f['lost']} | "
                     f"{_s(f['recovery'].get('total'))} |")
    return "\n".join(lines) + "\n"
