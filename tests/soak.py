r"""A randomized fault soak of the trainers: faults where they hurt, the end state bit for bit.

    python -m tests.soak --engine=tensorflow --workers=1 --faults=10 --seed=0
    python -m tests.soak --engine=jax --trainer=inception --workers=2 --faults=6 --seed=3

It runs the uninterrupted reference once, then the same command into
another --model_dir under faults drawn at random (`tests.soak_faults`): a
SIGKILL at a named write point or at a random instant, SIGTERM (then SIGKILL
after a grace of 1 or 5 s), a double SIGINT, a full disk or a read-only
directory mid-run, damaged files between launches, a concurrent second
launch, a killed relaunch of the finished run and, with two workers, a
killed, stopped or signalled worker. Several faults may share a launch (a
corruption before it, a concurrent launch beside it, one fault that ends
it). It relaunches until a launch finishes and has struck --faults faults,
printing each fault (category, kind, where, launch, outcome) as it goes and
the seed, so a failure can be replayed (faults at random instants at the
same drawn delays).

After every launch it checks that every JSON file parses strictly, that each
process ended with status 0, 130, 137 or 143, or 1 with the documented
one-line message, never a traceback; that a relaunch restored the newest
committed step (after a corruption, the newest readable one, saying which it
passed over), every worker the same step; that SIGTERM and SIGINT lost no
step and SIGKILL at most one checkpoint interval; and that no three
launches in a row made no progress. At the end the faulted run must equal
the uninterrupted one bit for bit (`tests.soak_state.differences`), with no
temporary file or scratch directory left.

The faulted run's --model_dir is on a tmpfs (mounting needs root; without
it the full-disk and read-only faults are not drawn, and the soak says so).
Exit status 0 when every check passed, 1 at the first that failed (its work
directory is kept and named).
"""

import argparse
import collections
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from tests import data_dirs
from tests import multi_worker
from tests import soak_faults as faults_lib
from tests import soak_launch
from tests import soak_state

_LAUNCH_TIMEOUT_S = 600
_CONCURRENT_TIMEOUT_S = 180
# A survivor of a lost or stopped worker ends within this (TensorFlow's
# collectives fail within seconds of a killed peer and about 11 s of a
# stopped one; JAX's coordination service declares a stopped process lost
# after its 100 s heartbeat timeout).
LOST_PEER_BOUND_S = {"tensorflow": 60, "jax": 150}
_GRACES_S = (1, 5)


class SoakFailure(AssertionError):
    """A check of the soak failed."""


@dataclasses.dataclass(frozen=True)
class Scenario:
    """The trainer command a soak runs: tiny settings, one or two workers, one engine."""

    trainer: str
    engine: str
    workers: int
    train_steps: int

    @property
    def module(self):
        return {"mnist": "trainers.mnist_sigmoid", "inception": "trainers.inception_bn"}[
            self.trainer
        ]

    @property
    def program(self):
        return self.module.rsplit(".", 1)[1]

    @property
    def eval_every(self):
        return 4 if self.trainer == "mnist" else 2

    @property
    def run_dirs(self):
        return ["batch_norm"] if self.trainer == "mnist" else [""]

    def args(self, model_dir):
        common = [f"--train_steps={self.train_steps}", f"--eval_every={self.eval_every}"]
        if self.trainer == "mnist":
            args = [
                "--norm=batch_norm",
                "--train_subset=600",
                "--batch_size=20",
                "--probe_size=50",
                f"--data_dir={data_dirs.SHARED_DATA}",
            ]
        else:
            args = [
                "--variant=bn_x5",
                "--dropout=0.4",  # BN, dropout and distortions: each resumed exactly.
                "--use_fake_data",
                "--image_size=32",
                "--batch_size=4",
                "--eval_steps=1",
                "--width_multiplier=0.05",
            ]
        if self.workers > 1:
            args.append(
                "--distribution_strategy="
                + ("multi_worker_mirrored" if self.engine == "tensorflow" else "data_parallel")
            )
            # One set of moving statistics for all replicas: with per-replica ones a TensorFlow
            # checkpoint holds their mean (docs/run_state.md), so a resumed run is not the same
            # bit for bit.
            args.append("--sync_batch_norm")
            if self.engine == "jax":
                args.append("--num_cpu_devices=1")
        return args + common + [f"--model_dir={model_dir}"]

    def env(self):
        env = {"KERAS_BACKEND": self.engine, "TF_CPP_MIN_LOG_LEVEL": "2"}
        if self.engine == "jax":
            # Every launch compiles the same functions: JAX's persistent cache (CI sets one).
            env["JAX_COMPILATION_CACHE_DIR"] = os.environ.get(
                "JAX_COMPILATION_CACHE_DIR",
                os.path.join(tempfile.gettempdir(), "keras_bn_soak_jax_cache"),
            )
            env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        return env

    def cluster_env(self, addresses, index):
        if self.engine == "tensorflow":
            return multi_worker.tf_config_env(addresses, index)
        return multi_worker.keras_distribution_env(addresses, index)


class Soak:
    """One soak: the reference run, the faulted run, the checks (see the module docstring)."""

    def __init__(self, scenario, faults, seed, work_dir, say=print):
        self.scenario = scenario
        self.faults_wanted = faults
        self.seed = seed
        self.rng = random.Random(seed)
        self.work_dir = work_dir
        self.say = say
        self.reference_dir = os.path.join(work_dir, "reference")
        self.disk = os.path.join(work_dir, "disk")
        self.model_dir = os.path.join(self.disk, "run")
        self.log_dir = os.path.join(work_dir, "logs")
        self.launches = 0
        self.struck = []  # The faults that struck, in order.
        self.finished = False
        self.stalled = 0  # Launches in a row without progress.
        self.on_tmpfs = False
        self.sequences = {}  # Worker → PointSequence of the reference.
        self.kinds = {}  # Category → the order its kinds are drawn in (`_kind`).
        self.points_struck = set()  # The fault points faults struck at.
        self.end_tried = False  # Whether `_finish` aimed a fault at the run's end.
        self.reference_seconds = 0.0
        self.startup_s = self.interval_s = 0.0
        self.lost_peer_seconds = []
        self.stop_seconds = []
        os.makedirs(self.log_dir, exist_ok=True)
        soak_launch.unignore_signals()

    # ---- the whole soak --------------------------------------------------------------------

    def run(self):
        s = self.scenario
        self.say(
            f"soak: {s.trainer} on {s.engine}, {s.workers} worker(s), {self.faults_wanted} "
            f"faults, seed {self.seed}; replay: python -m tests.soak --trainer={s.trainer} "
            f"--engine={s.engine} --workers={s.workers} --faults={self.faults_wanted} "
            f"--seed={self.seed}"
        )
        began = time.monotonic()
        self._reference()
        self._mount()
        try:
            self._faulted_run()
            problems = soak_state.differences(
                self.reference_dir, self.model_dir, s.run_dirs, self._tmp_dirs()
            )
            if problems:
                raise SoakFailure("the end state differs: " + "; ".join(problems))
        finally:
            self._unmount()
        by_kind = collections.Counter(
            f"{f.category}: {f.kind}" + (f" at '{f.point}'" if f.point else "") for f in self.struck
        )
        self.say(
            f"soak passed: {len(self.struck)} faults in {self.launches} launches, "
            f"{time.monotonic() - began:.0f} s; by kind:"
        )
        for kind, count in sorted(by_kind.items()):
            self.say(f"  {count:3d}  {kind}")
        if self.lost_peer_seconds:
            self.say(f"  survivors ended {max(self.lost_peer_seconds):.1f} s at most after a loss")
        if self.stop_seconds:
            self.say(f"  signals took effect {max(self.stop_seconds):.1f} s at most after sending")
        return self.struck

    def _tmp_dirs(self):
        tmp = os.path.join(self.log_dir, "tmp")
        return [os.path.join(tmp, d) for d in os.listdir(tmp)] if os.path.isdir(tmp) else []

    def _mount(self):
        os.makedirs(self.disk, exist_ok=True)
        mount = ["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", self.disk]
        self.on_tmpfs = subprocess.run(mount, capture_output=True).returncode == 0
        if not self.on_tmpfs:
            self.say("  (no tmpfs: mounting needs root; full-disk and read-only faults not drawn)")

    def _unmount(self):
        if self.on_tmpfs:
            # The faulted run is copied out first, so a failure leaves it to look at.
            target = os.path.join(self.work_dir, "faulted")
            if os.path.exists(self.model_dir) and not os.path.exists(target):
                shutil.copytree(self.model_dir, target, symlinks=True)
            subprocess.run(["umount", "-l", self.disk], capture_output=True)

    def _reference(self):
        began = time.monotonic()
        launch = soak_launch.Launch(self.scenario, self.reference_dir, self.log_dir, 0, {}).start()
        if not launch.wait(_LAUNCH_TIMEOUT_S):
            launch.kill()
            raise SoakFailure("the reference run did not end")
        self.reference_seconds = time.monotonic() - began
        for process in launch.processes:
            if process.code != 0:
                raise SoakFailure(f"the reference run failed:\n{process.output()[-3000:]}")
            self.sequences[process.worker] = faults_lib.PointSequence(
                process.points(), self.scenario.eval_every
            )
        # How long a launch starts up, and an interval takes (the chief's points' times).
        chief = launch.processes[0]
        first = chief.reached_at({"point": "evaluation", "count": 1})
        end = chief.reached_at({"point": "run end", "count": 1})
        intervals = self.scenario.train_steps / self.scenario.eval_every
        self.startup_s = first - chief.started
        self.interval_s = (end - first) / max(intervals - 1, 1)
        self.say(
            f"  reference: {self.reference_seconds:.1f} s (start-up {self.startup_s:.1f} s, "
            f"{self.interval_s:.2f} s an interval)"
        )

    def fault_points(self):
        """Every write point the run reaches: its reference's, and a relaunch's event rewrite."""
        points = {"event rewrite"}
        for sequence in self.sequences.values():
            points.update(sequence.expected(0, False))
        return points

    # ---- the faulted run -------------------------------------------------------------------

    def _categories(self):
        categories = (
            faults_lib.SINGLE_WORKER if self.scenario.workers == 1 else faults_lib.SEVERAL_WORKERS
        )
        if not self.on_tmpfs:
            categories = tuple(c for c in categories if c != faults_lib.STORAGE)
        return categories

    def _faulted_run(self):
        os.makedirs(self.model_dir, exist_ok=True)
        pending = faults_lib.draw_categories(self.faults_wanted, self._categories(), self.rng)
        last_clean = False
        limit = 4 * self.faults_wanted + 12
        while pending or not last_clean:
            if self.launches >= limit:
                raise SoakFailure(f"{self.launches} launches and still {len(pending)} faults to go")
            if not pending:
                last_clean = self._launch([], "a launch without faults")
                continue
            category = pending[0]
            if category == faults_lib.FINISHED and not self.finished:
                if all(c == faults_lib.FINISHED for c in pending):
                    self._finish()
                else:  # Later: the run has to finish first.
                    pending.append(pending.pop(0))
                continue
            if self.finished and category != faults_lib.FINISHED:
                category = pending[0] = faults_lib.FINISHED  # The run ended before its turn.
            struck = self._plan_and_launch(pending)
            last_clean = False
            del pending[:struck]

    def _finish(self):
        """Finishes the run: a launch without faults, but first, if no fault has struck the
        run's end yet, one killed there (a fault more than drawn): only the launch that
        finishes a run reaches its end."""
        points = self._expected_points(0)
        if "run end" in points and "run end" not in self.points_struck and not self.end_tried:
            self.end_tried = True
            occurrence = faults_lib.PointSequence.occurrence(points, points.index("run end"))
            hook = {"point": "run end", "count": occurrence, "action": "SIGKILL"}
            self._launch(
                [{"category": faults_lib.WRITE_POINT, "kind": "SIGKILL", "worker": 0, "hook": hook}]
            )
        else:
            self._launch([], "a launch without faults, to finish the run")

    def _plan_and_launch(self, pending):
        """Launches with the next pending categories' faults; returns how many of them struck."""
        c = faults_lib
        category = pending[0]
        if category == c.FINISHED:
            return self._finished_relaunch()
        if category == c.CORRUPTION:
            pre = self._corruption()
            if pre is None:  # Nothing to damage yet: a launch without it first.
                pending.append(pending.pop(0))
                return 0
            if pre.get("solo"):
                return self._launch([pre])
            return self._with_terminal([pre], pending)
        if category == c.CONCURRENT:
            return self._with_terminal([{"category": c.CONCURRENT}], pending)
        return self._launch([self._terminal(category)])

    def _with_terminal(self, parts, pending):
        """Launches `parts` (a corruption or a concurrent launch) with a fault that ends the
        launch: the next pending one's if it is of such a category, else a kill at a write
        point (one fault more than drawn), so that one launch does not train the rest of the
        run. Returns how many of the pending faults struck."""
        c = faults_lib
        terminal = pending[1] if len(pending) > 1 else None
        own = terminal in (c.WRITE_POINT, c.SIGNAL, c.STORAGE, c.LOST_WORKER)
        struck = self._launch(parts + [self._terminal(terminal if own else c.WRITE_POINT)])
        return min(struck, len(parts) + own)

    # ---- drawing the faults ---------------------------------------------------------------

    def _expected_points(self, worker):
        run_dir = self._run_dir()
        committed = soak_state.committed_step(run_dir)
        rewrites = faults_lib.files_to_rewrite(run_dir, committed) if worker == 0 else 0
        return self.sequences[worker].expected(committed, self.finished, rewrites)

    def _run_dir(self):
        return os.path.join(self.model_dir, self.scenario.run_dirs[0])

    def _point(self, worker, choices=None, within_blocks=2):
        """A `(point, count)` of the next launch of `worker`, early in its run so that it
        progresses; None if it reaches none of `choices`."""
        points = self._expected_points(worker)
        sequence = self.sequences[worker]
        committed = soak_state.committed_step(self._run_dir())
        blocks_left = sequence.blocks[committed // self.scenario.eval_every :]
        first_block = len(points) - sum(len(b) for b in blocks_left) - len(sequence.end)
        horizon = first_block + sum(len(b) for b in blocks_left[:within_blocks])
        if len(blocks_left) <= within_blocks:  # Near the end: the end's points too.
            horizon = len(points)
        if self.stalled >= 2:  # Two launches without progress: strike after a commit.
            start = points.index("checkpoint commit", first_block) + 1 if blocks_left else 0
        else:
            start = 0
        candidates = [i for i in range(start, horizon) if choices is None or points[i] in choices]
        if not candidates:
            candidates = [i for i in range(len(points)) if choices is None or points[i] in choices]
        if not candidates:
            return None
        # A point not struck yet in this soak within the horizon: a seldom one whenever
        # the launch reaches it, else the first half the time (every write point in turn;
        # the end's once the run is near it).
        fresh = [i for i in range(start, horizon) if points[i] not in self.points_struck]
        fresh = [i for i in fresh if choices is None or points[i] in choices]
        seldom = [i for i in fresh if points[i] in faults_lib.SELDOM_POINTS]
        if seldom:
            index = seldom[0]
        elif fresh and self.rng.random() < 0.5:
            index = fresh[0]
        else:
            index = self.rng.choice(candidates)
        return points[index], faults_lib.PointSequence.occurrence(points, index)

    def _instant(self):
        """A random instant of the next launch: `{"at_s": seconds after its start}`, in its
        start-up or its first two evaluation intervals as the reference's took, so that it
        progresses; after two launches without progress, `{"after_commit_s": ...}`: seconds
        after its first commit."""
        if self.stalled >= 2 and not self.finished:
            return {"after_commit_s": round(self.rng.uniform(0, 2 * self.interval_s), 3)}
        committed = soak_state.committed_step(self._run_dir())
        left = (
            0
            if self.finished
            else (self.scenario.train_steps - committed) / self.scenario.eval_every
        )
        horizon = self.startup_s + min(2, left) * self.interval_s
        return {"at_s": round(self.rng.uniform(0.3, max(1.0, horizon)), 3)}

    def _worker(self):
        return self.rng.randrange(self.scenario.workers)

    def _kind(self, category, kinds, allowed=None):
        """The next kind of `category`: each of `kinds` once, in a drawn order, then again.

        `allowed` (default: all) are those the run's state admits now; the
        first of them in the order is taken.
        """
        order = self.kinds.setdefault(category, [])
        allowed = kinds if allowed is None else allowed
        if not any(k in allowed for k in order):
            order += self.rng.sample(list(kinds), len(kinds))
        kind = next(k for k in order if k in allowed)
        order.remove(kind)
        return kind

    def _terminal(self, category):
        """A fault that ends a launch: of `category` (write point, signal, storage, lost worker)."""
        c = faults_lib
        worker = self._worker()
        if category == c.WRITE_POINT:
            point, count = self._point(worker)
            fault = {"point": point, "count": count, "action": "SIGKILL"}
            inside = c.INSIDE.get(point)
            if inside and self.rng.random() < 0.5:
                fault["delay_s"] = round(self.rng.uniform(0, inside), 4)
            return {"category": category, "kind": "SIGKILL", "worker": worker, "hook": fault}
        if category == c.SIGNAL:
            kind = self._kind(category, c.SIGNAL_KINDS)
            part = {"category": category, "kind": kind, "worker": worker}
            at = self._point(worker, c.SIGNAL_POINTS) if kind.endswith("at a point") else None
            if at is not None:
                part["hook"] = {"point": at[0], "count": at[1], "action": kind.split()[0]}
            else:  # At a random instant (a worker that reaches none of the points too).
                fallback = {"SIGTERM at a point": "SIGTERM then SIGKILL"}
                part["kind"] = kind = fallback.get(
                    kind, kind.replace("SIGINT at a point", "double SIGINT")
                )
                part.update(self._instant())
                part["grace_s"] = self.rng.choice(_GRACES_S)
                part["second_s"] = round(self.rng.uniform(0.05, 0.5), 3)
            return part
        if category == c.STORAGE:
            kind = self._kind(category, c.STORAGE_KINDS)
            point, count = self._point(worker, c.STORAGE_POINTS)
            hook = {"point": point, "count": count, "action": "SIGSTOP"}
            words = "No space left on device" if kind == "full disk" else "Read-only file system"
            return {
                "category": category,
                "kind": kind,
                "worker": worker,
                "hook": hook,
                "ends": rf"^{self.scenario.program}: error: {words}",
            }
        if category == c.LOST_WORKER:
            kind = self._kind(category, c.LOST_WORKER_KINDS)
            part = {"category": category, "kind": kind, "worker": worker}
            if kind == "SIGKILL inside a checkpoint save":
                point, count = self._point(worker, ("checkpoint write",))
                delay = round(self.rng.uniform(0, c.INSIDE["checkpoint write"]), 4)
                part["hook"] = {
                    "point": point,
                    "count": count,
                    "action": "SIGKILL",
                    "delay_s": delay,
                }
            else:
                part.update(self._instant())
            return part
        raise ValueError(category)

    def _corruption(self):
        """A damage to the faulted run's files before the next launch, or None if there is none."""
        c = faults_lib
        run_dir = self._run_dir()
        committed = soak_state.committed_step(run_dir)
        if not committed:
            return None
        steps = [s for s in soak_state.checkpoint_steps(run_dir) if s <= committed]
        kinds = ["torn event file", "garbled state file"]
        if self.stalled < 2:  # A refused launch makes no progress.
            kinds.append("corrupt record mid-file")
        if len(steps) >= 2:
            kinds.append("truncated newest checkpoint")
        kind = self._kind(c.CORRUPTION, c.CORRUPTION_KINDS, allowed=kinds)
        part = {"category": c.CORRUPTION, "kind": kind}
        if kind == "truncated newest checkpoint":
            part["where"] = c.truncate_checkpoint(run_dir, committed)
            part["warning"] = r"Checkpoint \S+ is unreadable, trying an older one"
        elif kind == "torn event file":
            part["where"] = c.tear_events(run_dir, committed, self.rng)
            part["warning"] = r"ends in a torn record"
        elif kind == "corrupt record mid-file":
            done = c.corrupt_events(run_dir, committed, self.rng)
            if done is None:
                return None
            part["where"], part["undo"] = done
            part["solo"] = True
            part["refusal"] = r"has a damaged record at byte \d+ .*not a torn end"
        else:
            state = os.path.join(run_dir, "checkpoints", "checkpoint")
            if self.scenario.engine == "tensorflow" and self.rng.random() < 0.5:
                c.garble(state, self.rng)  # The relaunch rebuilds it: never undone.
                part["where"] = "checkpoints/checkpoint"
                part["warning"] = r"checkpoint state file .* rebuilt"
            elif self.stalled >= 2:  # A refused launch makes no progress: the state file.
                return None
            else:
                part["where"] = "history.json"
                part["undo"] = c.garble(os.path.join(run_dir, "history.json"), self.rng)
                part["solo"] = True
                part["refusal"] = r"history\.json is damaged"
        return part

    # ---- one launch ------------------------------------------------------------------------

    def _launch(self, parts, label=None):
        """Launches the run with the faults `parts`; checks what follows; returns how many struck.

        For a launch without faults (`label` says why), returns whether it finished cleanly.
        """
        self.launches += 1
        number = self.launches
        run_dir = self._run_dir()
        committed = soak_state.committed_step(run_dir)
        history_before = _history_steps(run_dir)
        hooks = collections.defaultdict(list)
        for part in parts:
            if "hook" in part:
                hooks[part["worker"]].append(part["hook"])
        launch = soak_launch.Launch(self.scenario, self.model_dir, self.log_dir, number, hooks)
        launch.start()
        try:
            notes = self._during(launch, parts)
            if not launch.wait(_LAUNCH_TIMEOUT_S):
                raise SoakFailure(f"launch {number} still ran after {_LAUNCH_TIMEOUT_S} s")
        finally:
            launch.kill()
            for part in parts:
                if "undo" in part:
                    part.pop("undo")()
                if "after" in part:
                    part.pop("after")()
        self._check(launch, parts, committed, history_before)
        self._learn_startup(launch)
        if not parts:
            self.say(f"launch {number}: {label}: " + _codes(launch))
            return all(p.code == 0 for p in launch.processes)
        struck = 0
        for part in parts:
            fault = faults_lib.Fault(
                part["category"],
                part.get("kind", part["category"]),
                _where(part),
                number,
                notes.get(id(part), _codes(launch)),
                part.get("hook", {}).get("point"),
            )
            if part.get("missed"):
                fault.outcome = "not reached: " + fault.outcome
                self.say("  " + fault.line())
                continue
            struck += 1
            self.struck.append(fault)
            if fault.point:
                self.points_struck.add(fault.point)
            self.say(fault.line())
        return struck

    def _learn_startup(self, launch):
        """Keeps the fastest start-up seen (to the first evaluation): an instant drawn past a
        launch's whole run lets it finish unfaulted, and launches start faster than the
        reference once the machine's caches are warm."""
        chief = launch.processes[0]
        try:
            first = chief.reached_at({"point": "evaluation", "count": 1})
        except IndexError:  # It reached no evaluation (a finished run's relaunch, a kill).
            return
        self.startup_s = min(self.startup_s, first - chief.started)

    def _during(self, launch, parts):
        """Acts on the running launch as `parts` say; returns notes on what happened."""
        notes = {}
        stop_parts = [p for p in parts if p.get("hook", {}).get("action") == "SIGSTOP"]
        concurrent = [p for p in parts if p["category"] == faults_lib.CONCURRENT]
        timed = [p for p in parts if "at_s" in p or "after_commit_s" in p]
        if concurrent:
            notes[id(concurrent[0])] = self._concurrent(launch, concurrent[0])
        for part in stop_parts:
            notes[id(part)] = self._on_stop(launch, part)
        for part in timed:
            notes[id(part)] = self._timed(launch, part)
        for part in parts:
            hook = part.get("hook")
            if hook and hook["action"] != "SIGSTOP":
                launch.wait(_LAUNCH_TIMEOUT_S)
                process = launch.processes[part["worker"]]
                if process.points().count(hook["point"]) < hook["count"]:
                    part["missed"] = True
                elif hook["action"] in ("SIGTERM", "SIGINT") and not concurrent:
                    # (A concurrent launch stops the first one for a while.)
                    self.stop_seconds.append(time.monotonic() - process.reached_at(hook))
        return notes

    def _wait_stopped(self, process, timeout_s=_LAUNCH_TIMEOUT_S):
        deadline = time.monotonic() + timeout_s
        while process.running() and not process.stopped():
            if time.monotonic() > deadline:
                raise SoakFailure(f"worker {process.worker} never stopped at its point")
            time.sleep(0.02)
        return process.stopped()

    def _concurrent(self, launch, part):
        """Starts a second launch once the first holds the lock (stopped there): it must refuse
        in one line and change no file."""
        # The first launch stops where it holds the lock and has restored: a hook.
        first = launch.processes[0]
        deadline = time.monotonic() + _LAUNCH_TIMEOUT_S
        lock = os.path.join(self.model_dir, "trainer.lock")
        while first.running() and time.monotonic() < deadline:
            if "run state" in first.points():
                break
            time.sleep(0.02)
        if not first.running():
            part["missed"] = True
            return "the first launch ended before it could be joined"
        first.send(signal.SIGSTOP)
        try:
            if not self._wait_stopped(first, 30):  # Ended meanwhile (another fault's kill).
                part["missed"] = True
                return f"the first launch ended ({first.code}) before it could be joined"
            before = soak_state.snapshot(self.model_dir)
            second = soak_launch.Launch(
                dataclasses.replace(self.scenario, workers=1),
                self.model_dir,
                self.log_dir,
                launch.number * 1000 + 1,
                {},
            )
            second._start_once()
            if not second.wait(_CONCURRENT_TIMEOUT_S):
                second.kill()
                raise SoakFailure("the concurrent launch did not end")
            process = second.processes[0]
            out = process.output()
            after = soak_state.snapshot(self.model_dir)
        finally:
            first.send(signal.SIGCONT)
        line = faults_lib.last_line(out)
        pattern = (
            rf"^{self.scenario.program}: error: --model_dir=\S+ is in use by pid {first.popen.pid} "
        )
        if process.code != 1 or not re.search(pattern, line) or "Traceback" in out:
            raise SoakFailure(
                f"the concurrent launch did not refuse in one line ({process.code}): {out[-2000:]}"
            )
        if before != after:
            changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
            raise SoakFailure(f"the concurrent launch changed files: {changed[:5]}")
        with open(lock) as f:
            holder = f.read().strip()
        return f"refused in one line, no file changed (lock: {holder})"

    def _on_stop(self, launch, part):
        """Once the hooked worker stops at its point: fills the disk or makes it read-only."""
        process = launch.processes[part["worker"]]
        if not self._wait_stopped(process):
            part["missed"] = True
            part.pop("ends")
            return f"ended ({process.code}) before its point"
        if part["kind"] == "full disk":
            try:
                filler = faults_lib.fill_disk(self.disk)
            except OSError as error:  # Full before the fault: say by what.
                process.send(signal.SIGKILL)
                raise SoakFailure(
                    f"the disk was full before the fault ({error}): "
                    + faults_lib.disk_usage(self.disk)
                ) from error
            part["after"] = lambda: os.remove(filler)
        else:
            part["after"] = faults_lib.read_only(self.model_dir)
        process.send(signal.SIGCONT)
        launch.wait(_LAUNCH_TIMEOUT_S)
        return _codes(launch)

    def _timed(self, launch, part):
        """Sends a signal at `part["at_s"]` after the start (or `part["after_commit_s"]` after
        the first commit), as `part["kind"]` says."""
        process = launch.processes[part["worker"]]
        if "after_commit_s" in part:
            while process.running() and "checkpoint commit" not in process.points():
                time.sleep(0.005)
            deadline = time.monotonic() + part["after_commit_s"]
        else:
            deadline = process.started + part["at_s"]
        while process.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not process.running():
            part["missed"] = True
            return f"the launch ended ({process.code}) first"
        kind = part["kind"]
        sent = time.monotonic()
        others = [p for p in launch.processes if p is not process]
        if kind.startswith("SIGKILL"):
            process.send(signal.SIGKILL)
        elif kind.startswith("SIGTERM"):
            process.send(signal.SIGTERM)
            if kind == "SIGTERM then SIGKILL":
                if not launch.wait(part["grace_s"]):
                    process.send(signal.SIGKILL)
                    for other in others:
                        other.send(signal.SIGKILL)
        elif kind == "double SIGINT":
            process.send(signal.SIGINT)
            time.sleep(part["second_s"])
            process.send(signal.SIGINT)
        elif kind.startswith("SIGSTOP"):
            process.send(signal.SIGSTOP)
            bound = LOST_PEER_BOUND_S[self.scenario.engine]
            for other in others:
                if other.popen.poll() is not None:
                    continue
                try:
                    other.popen.wait(timeout=bound)
                except subprocess.TimeoutExpired:
                    raise SoakFailure(
                        f"worker {other.worker} still ran {bound} s after worker "
                        f"{process.worker} stopped"
                    ) from None
            self.lost_peer_seconds.append(time.monotonic() - sent)
            process.send(signal.SIGKILL if kind.endswith("SIGKILL") else signal.SIGCONT)
            try:
                process.popen.wait(timeout=bound)
            except subprocess.TimeoutExpired:
                raise SoakFailure(
                    f"worker {process.worker} still ran {bound} s after its SIGCONT"
                ) from None
            return _codes(launch)
        if others and kind.startswith("SIGKILL"):
            bound = LOST_PEER_BOUND_S[self.scenario.engine]
            if not launch.wait(bound):
                raise SoakFailure(
                    f"a survivor still ran {bound} s after worker {process.worker} was killed"
                )
            self.lost_peer_seconds.append(time.monotonic() - sent)
        launch.wait(_LAUNCH_TIMEOUT_S)
        if not kind.startswith("SIGKILL"):
            self.stop_seconds.append(time.monotonic() - sent)
        return _codes(launch)

    # ---- the checks after a launch ---------------------------------------------------------

    def _check(self, launch, parts, committed, history_before):
        program = self.scenario.program
        run_dir = self._run_dir()
        for process in launch.processes:
            out = process.output()
            where = f"launch {launch.number}, worker {process.worker}"
            if "Traceback (most recent call last)" in out:
                raise SoakFailure(f"{where}: a traceback:\n{out[-4000:]}")
            if process.code not in (0, 1, 130, 137, 143):
                raise SoakFailure(f"{where}: exit status {process.code}:\n{out[-3000:]}")
            line = faults_lib.last_line(out)
            if process.code == 1 and not re.fullmatch(rf"{program}: error: .+", line):
                raise SoakFailure(f"{where}: status 1 without the one-line message: {line!r}")
            for part in parts:
                if part.get("refusal") and process.worker == 0:
                    if process.code != 1 or not re.search(part["refusal"], line):
                        raise SoakFailure(
                            f"{where}: {part['kind']} not refused in one line: {line!r}"
                        )
                # Said by the restore or the event files' cut, before the first evaluation.
                if (
                    part.get("warning")
                    and process.worker == 0
                    and "evaluation" in process.points()
                    and not re.search(part["warning"], out)
                ):
                    raise SoakFailure(f"{where}: no warning for {part['kind']} ({part['warning']})")
            resumed = re.findall(r"Resumed from (\S+) at step (\d+)", out)
            if resumed and int(resumed[-1][1]) != committed:
                raise SoakFailure(
                    f"{where}: resumed at step {resumed[-1][1]}, the newest commit is {committed}"
                )
            if (
                resumed
                and self.scenario.workers > 1
                and f"(all {self.scenario.workers} workers)" not in out
            ):
                raise SoakFailure(f"{where}: did not say every worker resumed at its step")
        for part in parts:
            if not part.get("missed"):
                self._check_ends(launch, part)
        resumed_steps = {
            m
            for p in launch.processes
            for m in re.findall(r"Resumed from \S+ at step (\d+)", p.output())
        }
        if len(resumed_steps) > 1:
            raise SoakFailure(f"launch {launch.number}: workers resumed at steps {resumed_steps}")
        stop_steps = {
            m.group(1) for p in launch.processes if (m := faults_lib.STOP_LINE.search(p.output()))
        }
        if len(stop_steps) > 1:
            raise SoakFailure(f"launch {launch.number}: workers stopped at steps {stop_steps}")
        problems = soak_state.strict_json_problems(self.model_dir)
        if problems:
            raise SoakFailure(f"launch {launch.number}: not strict JSON: {problems}")
        after = soak_state.committed_step(run_dir)
        history_after = _history_steps(run_dir)
        for process in launch.processes:
            stop = faults_lib.STOP_LINE.search(process.output())
            if stop and process.code in (130, 143) and after != int(stop.group(1)):
                raise SoakFailure(
                    f"launch {launch.number}: stopped at step {stop.group(1)} but the newest "
                    f"commit is {after}: a step was lost"
                )
        # Of the steps this launch recorded, a kill loses at most those since its last commit.
        advanced = history_after is not None and history_after != history_before
        if advanced and after < history_after - self.scenario.eval_every:
            raise SoakFailure(
                f"launch {launch.number}: history at step {history_after}, newest commit {after}: "
                "more than one checkpoint interval lost"
            )
        finished = _finished(run_dir) and all(p.code == 0 for p in launch.processes)
        progressed = after > max(committed, 0) or (finished and not self.finished)
        self.finished = self.finished or finished
        self.stalled = 0 if progressed or self.finished else self.stalled + 1
        if self.stalled >= 3:
            raise SoakFailure(f"three launches in a row without progress (at step {after})")

    def _check_ends(self, launch, part):
        """Checks each worker's exit status and last line against what `part`'s fault allows."""
        kind, program = part.get("kind", ""), self.scenario.program
        for process in launch.processes:
            target = process.worker == part.get("worker")
            line = faults_lib.last_line(process.output())
            done = _finished(self._run_dir())  # The run had ended: status 0 is right then.
            if "ends" in part and target:
                allowed, pattern = {1}, part["ends"]
            elif part["category"] == faults_lib.LOST_WORKER and not kind.startswith("SIGTERM"):
                if target:
                    allowed, pattern = {1, 137}, rf"^{program}: error: lost "
                else:
                    allowed, pattern = {1} | ({0} if done else set()), rf"^{program}: error: lost "
            elif "SIGTERM" in kind and (target or part["category"] == faults_lib.LOST_WORKER):
                allowed, pattern = {143, 137 if "SIGKILL" in kind else 143}, None
            elif "SIGINT" in kind and target:
                allowed, pattern = {130}, None
            elif kind.startswith("SIGKILL") and target:
                allowed, pattern = {137}, None
            else:
                continue
            if done and "ends" not in part:
                allowed = allowed | {0}
            if process.code not in allowed:
                raise SoakFailure(
                    f"launch {launch.number}, worker {process.worker}: {kind}: exit status "
                    f"{process.code}, not one of {sorted(allowed)}:\n{process.output()[-2000:]}"
                )
            if pattern and process.code == 1 and not re.search(pattern, line):
                raise SoakFailure(
                    f"launch {launch.number}, worker {process.worker}: {kind}: last line {line!r}"
                )

    def _finished_relaunch(self):
        """Relaunches the finished run, killed at one of its writes or at a random instant."""
        worker = self._worker()
        part = {"category": faults_lib.FINISHED, "worker": worker}
        # A worker that writes nothing in a finished run's relaunch (not the
        # chief) reaches no point: it is killed at a random instant.
        at_point = self._point(worker) if self.rng.random() < 0.7 else None
        if at_point:
            point, count = at_point
            part["kind"] = "SIGKILL"
            part["hook"] = {"point": point, "count": count, "action": "SIGKILL"}
        else:
            part["kind"] = "SIGKILL at a random instant"
            part.update(self._instant())
        return self._launch([part])


def _history_steps(run_dir):
    try:
        with open(os.path.join(run_dir, "history.json")) as f:
            return json.load(f).get("steps", 0)
    except (FileNotFoundError, ValueError):
        return None


def _finished(run_dir):
    try:
        with open(os.path.join(run_dir, "history.json")) as f:
            return bool(json.load(f).get("finished"))
    except (FileNotFoundError, ValueError):
        return False


def _codes(launch):
    return "exit " + ", ".join(str(p.code) for p in launch.processes)


def _where(part):
    if "hook" in part:
        hook = part["hook"]
        delay = f" +{hook['delay_s']} s" if hook.get("delay_s") else ""
        where = f"at '{hook['point']}' #{hook['count']}{delay}"
    elif "at_s" in part or "after_commit_s" in part:
        where = (
            f"at {part['at_s']} s"
            if "at_s" in part
            else f"{part['after_commit_s']} s after a commit"
        )
        if part.get("kind") == "SIGTERM then SIGKILL":
            where += f", grace {part['grace_s']} s"
        if part.get("kind") == "double SIGINT":
            where += f", the second {part['second_s']} s later"
    else:
        where = part.get("where", "")
    if "worker" in part and part["category"] not in (faults_lib.CORRUPTION, faults_lib.CONCURRENT):
        where += f" (worker {part['worker']})"
    return where


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainer", choices=("mnist", "inception"), default="mnist")
    parser.add_argument("--engine", choices=("tensorflow", "jax"), default="tensorflow")
    parser.add_argument("--workers", type=int, choices=(1, 2), default=1)
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--train_steps", type=int, default=None, help="default: room for every fault"
    )
    parser.add_argument("--work_dir", default=None)
    args = parser.parse_args(argv)
    scenario = scenario_for(args.trainer, args.engine, args.workers, args.faults, args.train_steps)
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="keras_bn_soak_")
    try:
        Soak(scenario, args.faults, args.seed, work_dir).run()
    except SoakFailure as failure:
        print(f"soak FAILED (seed {args.seed}; work directory kept: {work_dir}): {failure}")
        return 1
    shutil.rmtree(work_dir, ignore_errors=True)
    return 0


def scenario_for(trainer, engine, workers, faults, train_steps=None):
    """The soak's command: `train_steps` (default: an evaluation interval per fault and more)."""
    every = 4 if trainer == "mnist" else 2
    return Scenario(trainer, engine, workers, train_steps or every * (faults + 4))


if __name__ == "__main__":
    sys.exit(main())
