"""The fault soak's faults: what each does to a run, and what the run must do then.

A fault is drawn where it hurts: at a named write point of the trainer
(`trainers.run.fault_points`, reached through the test-only hook), at a
random instant, between launches on the files a launch left, or beside a
launch. Each fault belongs to one category; `CATEGORIES` lists them, and a
soak of at least as many faults as categories draws each once before it
draws at random.

What each module here holds is how a fault is applied; `tests.soak` draws
them, launches, and checks what follows.
"""

import dataclasses
import os
import re
import struct
import subprocess

# The categories of faults, in the order a soak first draws them.
WRITE_POINT = "kill at a write point"
SIGNAL = "signal"
STORAGE = "full disk or read-only directory"
CORRUPTION = "corruption between launches"
CONCURRENT = "concurrent launch"
FINISHED = "killed relaunch of a finished run"
LOST_WORKER = "lost or stopped worker"
SINGLE_WORKER = (WRITE_POINT, SIGNAL, STORAGE, CORRUPTION, CONCURRENT, FINISHED)
SEVERAL_WORKERS = (LOST_WORKER, WRITE_POINT, SIGNAL, FINISHED)

# The kinds of each category; a soak draws each once before it draws one again.
SIGNAL_KINDS = (
    "SIGKILL at a random instant",
    "SIGTERM then SIGKILL",
    "SIGTERM at a point",
    "double SIGINT",
    "SIGINT at a point",
)
STORAGE_KINDS = ("full disk", "read-only directory")
CORRUPTION_KINDS = (
    "truncated newest checkpoint",
    "torn event file",
    "corrupt record mid-file",
    "garbled state file",
)
LOST_WORKER_KINDS = (
    "SIGKILL at a random instant",
    "SIGKILL inside a checkpoint save",
    "SIGSTOP, then SIGCONT",
    "SIGSTOP, then SIGKILL",
    "SIGTERM to one worker",
)

# Write points and where inside their write a delayed kill lands (seconds after the point).
INSIDE = {"checkpoint write": 0.03, "evaluation": 0.05}
# The points of the end-of-run writes (the results after the run's end commit).
END_WRITES = ("run end",)
# Where a stopped process's disk fills or turns read-only: before the writes that follow.
STORAGE_POINTS = ("evaluation", "checkpoint write", "run end", "rename history.json")
# Phases a SIGTERM or SIGINT is delivered in through the hook (start-up, evaluation, the end).
SIGNAL_POINTS = ("rename trainer.json", "run state", "evaluation", "run end")
# Points a launch seldom reaches: a relaunch rewrites event files only after a tear or a
# kill left events past the commit, and a run ends once. A fault drawn at a point takes
# one of these first while the soak has not struck it (a long soak strikes every point).
SELDOM_POINTS = ("event rewrite",) + END_WRITES


@dataclasses.dataclass
class Fault:
    """One fault of a soak, as the report prints it."""

    category: str
    kind: str
    where: str
    launch: int = 0
    outcome: str = ""
    point: str | None = None  # The fault point it struck at, if any.

    def line(self):
        return f"launch {self.launch}: {self.category}: {self.kind} {self.where} -> {self.outcome}"


class PointSequence:
    """The fault points a launch of the run reaches, in order, modelled on the reference run's.

    A fresh launch reaches the reference's start-up points, then one block
    of points per evaluation interval, then the end's; a relaunch from
    committed step C writes the history once more at start-up and skips the
    blocks of the intervals before C; a relaunch of a finished run reaches
    the start-up points and the results' writes only.
    """

    def __init__(self, reference_points, eval_every):
        self.eval_every = eval_every
        first = reference_points.index("evaluation") if "evaluation" in reference_points else None
        end = reference_points.index("run end") if "run end" in reference_points else None
        last = end if end is not None else len(reference_points)
        self.prefix = reference_points[:first] if first is not None else reference_points[:last]
        self.blocks = []
        for point in reference_points[first:last] if first is not None else []:
            if point == "evaluation":
                self.blocks.append([])
            self.blocks[-1].append(point)
        self.end = reference_points[last:]

    def expected(self, committed, finished, rewrites=0):
        """The points a launch from `committed` reaches (`finished`: the run has ended), with
        `rewrites` event files cut back at its start."""
        if finished:
            # The results' writes: what follows the end's own commit (its history write).
            results = self.end[1:]
            if "rename history.json" in results:
                results = results[results.index("rename history.json") + 1 :]
            return list(self.prefix) + results
        prefix = list(self.prefix)
        if committed and "run state" in prefix:
            # The history cut back to the commit, then the event files (`keep_through`).
            at = prefix.index("run state") + 1
            prefix[at:at] = ["rename history.json"] + ["event rewrite"] * rewrites
        start = committed // self.eval_every
        return prefix + [p for block in self.blocks[start:] for p in block] + list(self.end)

    @staticmethod
    def occurrence(points, index):
        """How many times `points[index]` comes in `points[: index + 1]`."""
        return points[: index + 1].count(points[index])


def fill_disk(directory):
    """Fills the file system of `directory`; returns the filler's path (remove it to undo)."""
    path = os.path.join(directory, "soak_filler")
    stats = os.statvfs(directory)
    with open(path, "wb") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, stats.f_bavail * stats.f_frsize)
        except OSError:
            pass
        chunk = b"\0" * 65536
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError:
            pass
    return path


def disk_usage(directory):
    """The file system's free space and inodes, and its five largest files, in words."""
    stats = os.statvfs(directory)
    sizes = []
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            try:
                sizes.append((os.lstat(path).st_blocks * 512, path))
            except OSError:
                pass
    largest = ", ".join(f"{path} ({size} B)" for size, path in sorted(sizes, reverse=True)[:5])
    return (
        f"{stats.f_bavail * stats.f_frsize} B and {stats.f_favail} inodes free, "
        f"{len(sizes)} files, the largest: {largest}"
    )


def read_only(directory):
    """Makes `directory` read-only from here on (a read-only bind mount over itself).

    Files already open for writing stay writable, as on a file system
    remounted read-only under a running process; new writes fail with EROFS.
    Returns the undo.
    """
    subprocess.run(["mount", "--bind", directory, directory], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", directory], check=True)
    return lambda: subprocess.run(["umount", directory], check=True)


def truncate_checkpoint(run_dir, step):
    """Cuts the largest file of checkpoint `step` to half; returns what it cut."""
    directory = os.path.join(run_dir, "checkpoints")
    files = [
        os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(f"ckpt-{step}.")
    ]
    if not files:  # Orbax: the files under the step's directory.
        files = [
            os.path.join(d, n)
            for d, _, names in os.walk(os.path.join(directory, str(step)))
            for n in names
        ]
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return os.path.relpath(path, run_dir)


def _records(path):
    """`[(offset, length, step)]` of the TFRecord-framed events of `path` (whole ones)."""
    from tensorboard.compat.proto import event_pb2

    with open(path, "rb") as f:
        data = f.read()
    out, offset = [], 0
    while offset + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        end = offset + 16 + length
        if end > len(data):
            break
        step = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length]).step
        out.append((offset, length, step))
        offset = end
    return out


def files_to_rewrite(run_dir, committed):
    """How many of the run's event files hold events after `committed` or a torn end."""
    count = 0
    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
        if not name.startswith("events.out.tfevents.") or name.endswith(".end"):
            continue
        path = os.path.join(run_dir, name)
        records = _records(path)
        whole = sum(16 + length for _, length, _ in records) == os.path.getsize(path)
        count += any(step > committed for _, _, step in records) or not whole
    return count


def newest_event_file(run_dir):
    names = sorted(
        n
        for n in os.listdir(run_dir)
        if n.startswith("events.out.tfevents.") and not n.endswith(".end")
    )
    return os.path.join(run_dir, names[-1]) if names else None


def tear_events(run_dir, committed, rng):
    """Tears the end of the run's newest event file where a killed write could; returns where.

    Only bytes after the committed events can be torn by a kill (the run
    flushes its events before it checkpoints): the file is cut inside a
    record of a later step if it has one, else a partial copy of its last
    record is appended.
    """
    path = newest_event_file(run_dir)
    records = _records(path)
    later = [r for r in records if r[2] > committed]
    with open(path, "r+b") as f:
        if later:
            offset, length, _ = rng.choice(later)
            cut = offset + rng.randrange(1, 16 + length)
            f.truncate(cut)
            return f"{os.path.basename(path)} cut at byte {cut}"
        offset, length, _ = records[-1]
        f.seek(offset)
        record = f.read(16 + length)
        f.seek(0, os.SEEK_END)
        part = rng.randrange(1, 16 + length)
        f.write(record[:part])
        return f"{os.path.basename(path)} + {part} bytes of a record"


def corrupt_events(run_dir, committed, rng):
    """Flips a byte inside a committed record of the run's newest event file, not its last.

    Returns `(where, undo)`, or None when the file has too few records.
    """
    path = newest_event_file(run_dir)
    records = [r for r in _records(path) if r[2] <= committed][:-1]
    if len(records) < 2:
        return None
    offset, length, _ = rng.choice(records[1:])
    at = offset + 12 + rng.randrange(length)
    with open(path, "r+b") as f:
        f.seek(at)
        original = f.read(1)
        f.seek(at)
        f.write(bytes([original[0] ^ 0xFF]))

    def undo():
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(original)

    return f"{os.path.basename(path)} byte {at}", undo


def garble(path, rng):
    """Overwrites `path` with garbage; returns the undo."""
    with open(path, "rb") as f:
        original = f.read()
    with open(path, "wb") as f:
        f.write(bytes(rng.randrange(256) for _ in range(max(8, len(original) // 2))))

    def undo():
        with open(path, "wb") as f:
            f.write(original)

    return undo


def draw_categories(count, categories, rng):
    """`count` categories: each of `categories` once (in random order) while they last, then any."""
    first = list(categories)
    rng.shuffle(first)
    return (first + [rng.choice(categories) for _ in range(count)])[:count]


def last_line(output):
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else ""


STOP_LINE = re.compile(r": stopped at step (\d+) on (SIGTERM|SIGINT); ")
