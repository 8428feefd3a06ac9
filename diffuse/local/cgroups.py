"""cgroup v1 groups made for a run (a CPU quota, a memory limit), for benches and tests of unequal nodes.

``Cgroups(tag)`` finds this process's own v1 ``cpu`` and ``memory`` groups and says in ``why`` what
stops it where groups cannot be made here (not root, no v1 controllers, not writable). ``make`` creates a
pair of groups under them with a CFS quota of ``cpus`` cores; ``enter`` moves a process (and, where the
kernel still moves charges, what it holds) into a pair; ``limit_memory`` caps a memory group; ``close``
removes every group it made, waiting a moment for the processes to leave.

A quota is enforced per CFS period: in each period a group runs at most ``cpus`` times the period. With
the kernel's default period (100 ms) a process that idles between short bursts of work (a node of a ring,
waiting its turn) spends the quota it saved while idle and runs its bursts at the speed of a whole core;
only work longer than the quota of one period is slowed. ``make``'s ``period_us`` shortens the period so
that a node at a third of a core computes at a third of a core's speed from its first millisecond.
"""

from __future__ import annotations

import os
import time

DEFAULT_PERIOD_US = 100_000  # the kernel's own


def own_v1_group(controller: str) -> str | None:
    """This process's innermost cgroup v1 folder for ``controller`` (None where there is none)."""
    from diffuse.plan.reports import cgroup_dirs

    found = [d for d, version in cgroup_dirs(controller) if version == "v1"]
    return found[0] if found else None


def memory_used(folder: str) -> int:
    """Bytes a v1 memory group holds, less its inactive file cache (what a limit would squeeze first)."""
    from diffuse.plan.reports import stat_value

    with open(os.path.join(folder, "memory.usage_in_bytes")) as f:
        return int(f.read()) - stat_value(folder, "total_inactive_file")


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


class Cgroups:
    """cgroup v1 groups (cpu and memory) made for one run, removed by ``close``."""

    def __init__(self, tag: str):
        self.tag, self.made = tag, []
        self.cpu, self.memory = own_v1_group("cpu"), own_v1_group("memory")
        why = None
        if os.geteuid() != 0:
            why = "not root"
        elif not self.cpu or not self.memory:
            why = "no cgroup v1 cpu and memory controllers"
        elif not (os.access(self.cpu, os.W_OK) and os.access(self.memory, os.W_OK)):
            why = f"{self.cpu} or {self.memory} is not writable"
        self.why = why

    def make(self, name: str, cpus: float, period_us: int = DEFAULT_PERIOD_US, shares: int | None = None
             ) -> list[str]:
        """A cpu group with a quota of ``cpus`` cores per ``period_us`` (and ``shares``, its weight against
        other work when the machine is busy, where given) and a memory group; their folders."""
        folders = [os.path.join(self.cpu, f"{self.tag}-{name}"), os.path.join(self.memory, f"{self.tag}-{name}")]
        for f in folders:
            os.mkdir(f)
            self.made.append(f)
        _write(os.path.join(folders[0], "cpu.cfs_period_us"), period_us)
        _write(os.path.join(folders[0], "cpu.cfs_quota_us"), max(1000, int(period_us * cpus)))
        if shares is not None:
            _write(os.path.join(folders[0], "cpu.shares"), shares)
        return folders

    @staticmethod
    def enter(folders: list[str], pid: int) -> None:
        """Move process ``pid`` into the groups ``folders`` (what it holds comes along where the kernel still
        moves charges; newer ones do not: then the group counts only what it takes from now on, which is what
        a limit is about)."""
        for folder in folders:
            if os.path.exists(os.path.join(folder, "memory.move_charge_at_immigrate")):
                try:
                    _write(os.path.join(folder, "memory.move_charge_at_immigrate"), 3)
                except OSError:
                    pass
            _write(os.path.join(folder, "cgroup.procs"), pid)

    @staticmethod
    def cpu_stat(folder: str) -> dict[str, int]:
        """A cpu group's ``cpu.stat``: ``nr_periods``, ``nr_throttled`` and ``throttled_time`` (ns) so far (empty
        where it cannot be read)."""
        try:
            with open(os.path.join(folder, "cpu.stat")) as f:
                return {k: int(v) for k, v in (line.split()[:2] for line in f if len(line.split()) >= 2)}
        except (OSError, ValueError):
            return {}

    @staticmethod
    def limit_memory(folder: str, limit: int) -> None:
        _write(os.path.join(folder, "memory.limit_in_bytes"), limit)

    def leave(self, pid: int) -> None:
        """Move ``pid`` back to the groups this process started in."""
        for folder in (self.cpu, self.memory):
            try:
                _write(os.path.join(folder, "cgroup.procs"), pid)
            except OSError:
                pass

    def close(self) -> None:
        """Remove the groups made, moving any process still in one (one forked while its parent was there) to
        the group above it."""
        for f in reversed(self.made):
            try:
                with open(os.path.join(f, "cgroup.procs")) as procs:
                    for pid in procs.read().split():
                        try:
                            _write(os.path.join(os.path.dirname(f), "cgroup.procs"), pid)
                        except OSError:  # gone meanwhile
                            pass
            except OSError:
                pass
            for _ in range(50):  # its processes take a moment to leave it
                try:
                    os.rmdir(f)
                    break
                except OSError:
                    time.sleep(0.1)
        self.made = []
