"""Slurm job steps (``srun``), and Slurm's compressed formats (hostlists, task counts per node)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Final, NoReturn

from ..errors import LauncherError
from .common import Claim, Topology, derive_port, env_int, env_port, first_set

__all__ = ["SLURM", "SlurmDetector", "expand_hostlist", "expand_tasks_per_node"]

# Slurm's special step ids (slurm.h): the batch script, the extern step, the interactive step of salloc,
# pending steps. Their processes are not tasks of a user step, like the batch step without SLURM_STEP_ID.
_SLURM_SPECIAL_STEP_MIN: Final = 0xFFFFFFF0
_SLURM_SPECIAL_STEP_NAMES: Final = frozenset({"batch", "extern", "interactive", "pending"})


# ---------------------------------------------------------------------------------------------------------
# Hostlists and compressed task counts (Slurm's formats)
# ---------------------------------------------------------------------------------------------------------


def _split_top_level(s: str, what: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in s:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise LauncherError(f"{what} {s!r}: nested '[' is not valid")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LauncherError(f"{what} {s!r}: ']' without '['")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise LauncherError(f"{what} {s!r}: '[' without ']'")
    parts.append("".join(cur))
    return parts


def _expand_range_group(body: str, whole: str) -> list[str]:
    """``01-04,07`` -> ['01', '02', '03', '04', '07'] (width kept from the start of each range)."""
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise LauncherError(f"hostlist {whole!r}: {item!r} in '[{body}]' is not a number or a range a-b")
        lo_text, hi_text = m.group(1), m.group(2)
        if hi_text is None:
            out.append(lo_text)
            continue
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise LauncherError(f"hostlist {whole!r}: range {item!r} runs backwards")
        # Slurm pads every number of a range to the width of its first bound: [08-10] -> 08 09 10
        width = len(lo_text)
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def expand_hostlist(s: str) -> list[str]:
    """Expand a Slurm hostlist expression into host names, in Slurm's order.

    ``node[01-04,07]`` -> node01..node04, node07; ``a[1-2]-ib,b3`` -> a1-ib, a2-ib, b3; several bracket
    groups make a product with the last group varying fastest (``r[1-2]n[01-02]`` -> r1n01, r1n02, r2n01,
    r2n02), which is what ``scontrol show hostnames`` prints. Zero padding is kept from each range's start.

    Raises:
        LauncherError: unbalanced or nested brackets, a bracket item that is not a number or range, a
            backwards range, or an empty list.
    """
    text = (s or "").strip()
    if not text:
        raise LauncherError("hostlist is empty: the launcher did not say which nodes the job has")
    hosts: list[str] = []
    for part in _split_top_level(text, "hostlist"):
        part = part.strip()
        if not part:
            raise LauncherError(f"hostlist {s!r} has an empty entry")
        # A host pattern alternates literal text and bracket groups; each group multiplies the names.
        expansions = [""]
        for literal, group in re.findall(r"([^\[\]]*)(\[[^\]]*\])?", part):
            choices = [literal]
            if group:
                if group == "[]":
                    raise LauncherError(f"hostlist {s!r}: empty brackets in {part!r}")
                choices = [literal + item for item in _expand_range_group(group[1:-1], s)]
            expansions = [prefix + c for prefix in expansions for c in choices]
        hosts.extend(expansions)
    return hosts


def expand_tasks_per_node(s: str) -> list[int]:
    """Expand Slurm's compressed tasks-per-node form: ``2(x3),1`` -> ``[2, 2, 2, 1]``.

    Raises:
        LauncherError: an entry that is not ``N`` or ``N(xM)`` with positive integers.
    """
    text = (s or "").strip()
    if not text:
        raise LauncherError("tasks-per-node list is empty")
    out: list[int] = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", item)
        if not m or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise LauncherError(f"tasks-per-node {s!r}: {item!r} is not 'N' or 'N(xM)' with N, M >= 1")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


class SlurmDetector:
    """A task of a SLURM job step (``srun``); the batch script and an ``salloc`` shell are not one."""

    name: Final = "slurm"
    variables: Final = (
        "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
        "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_STEP_NUM_NODES",
        "SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_NODELIST",
        "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURMD_NODENAME", "MASTER_ADDR", "MASTER_PORT",
    )

    @staticmethod
    def step(env: Mapping[str, str]) -> tuple[str, str] | None:
        name = first_set(env, "SLURM_STEP_ID", "SLURM_STEPID")
        return (name, env[name].strip()) if name else None

    @staticmethod
    def is_task_step(step_id: str) -> bool:
        if step_id.lower() in _SLURM_SPECIAL_STEP_NAMES:
            return False
        return not (step_id.isdigit() and int(step_id) >= _SLURM_SPECIAL_STEP_MIN)

    def claim(self, env: Mapping[str, str], argv: Sequence[str]) -> Claim | None:
        """Why this process looks like a task of an ``srun`` step, or None (batch step, salloc, no SLURM)."""
        step = self.step(env)
        if step is None or not env.get("SLURM_PROCID", "").strip() or not self.is_task_step(step[1]):
            return None
        return Claim(f"{step[0]}={step[1]} and SLURM_PROCID={env['SLURM_PROCID']} are set (a task of srun "
                      f"step {env.get('SLURM_JOB_ID', '?')}.{step[1]})")

    def topology(self, env: Mapping[str, str], argv: Sequence[str], claim: Claim | None) -> Topology:
        """The step's topology, validated: tasks per node x nodes must equal the number of tasks."""
        if claim is None:
            self._raise_not_a_step(env)
        ntasks_var = first_set(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
        # Step values first: a step may use a subset of the job's nodes (`srun -N1 -w node2` inside an
        # `sbatch -N2` job gives SLURM_JOB_NUM_NODES=2 but SLURM_NNODES=1 and a step-relative SLURM_NODEID=0).
        nodes_var = first_set(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
        tpn_var = first_set(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        missing = [label for label, var in (("SLURM_LOCALID", first_set(env, "SLURM_LOCALID")),
                                            ("SLURM_NODEID", first_set(env, "SLURM_NODEID")),
                                            ("SLURM_STEP_NUM_TASKS or SLURM_NTASKS", ntasks_var),
                                            ("SLURM_STEP_NUM_NODES or SLURM_NNODES", nodes_var),
                                            ("SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE", tpn_var))
                   if var is None]
        if missing:
            raise LauncherError(f"{claim.reason}, but {', '.join(missing)} missing: this does not look like "
                                "a complete srun task environment. Start the script with `srun python script.py`")
        assert ntasks_var and nodes_var and tpn_var  # for type checkers: checked just above
        rank = env_int(env, "SLURM_PROCID")
        local_rank = env_int(env, "SLURM_LOCALID")
        node_rank = env_int(env, "SLURM_NODEID")
        world = env_int(env, ntasks_var, minimum=1)
        num_nodes = env_int(env, nodes_var, minimum=1)
        per_node = expand_tasks_per_node(env[tpn_var])
        if len(per_node) != num_nodes or sum(per_node) != world:
            raise LauncherError(
                f"inconsistent SLURM step: {tpn_var}={env[tpn_var]!r} expands to {per_node} "
                f"({len(per_node)} node(s), {sum(per_node)} task(s)) but {nodes_var}={env[nodes_var]!r} and "
                f"{ntasks_var}={env[ntasks_var]!r}. Ask srun for a consistent layout, e.g. "
                "`srun -N<nodes> --ntasks-per-node=<tasks>` with ntasks = nodes x tasks-per-node")
        if not 0 <= rank < world:
            raise LauncherError(f"SLURM_PROCID={env['SLURM_PROCID']!r} is not below {ntasks_var}={env[ntasks_var]!r}")
        if not 0 <= node_rank < num_nodes:
            raise LauncherError(f"SLURM_NODEID={env['SLURM_NODEID']!r} is not below {nodes_var}={env[nodes_var]!r}")
        local_world = per_node[node_rank]
        if not 0 <= local_rank < local_world:
            raise LauncherError(f"SLURM_LOCALID={env['SLURM_LOCALID']!r} is not below the {local_world} task(s) "
                                f"of node {node_rank} ({tpn_var}={env[tpn_var]!r})")
        addr, addr_how = self._master_addr(env)
        port, port_how = self._master_port(env)
        return Topology(
            launcher="slurm", rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
            node_rank=node_rank, num_nodes=num_nodes, master_addr=addr, master_port=port,
            reason=f"{claim.reason}; master {addr_how}, port {port_how}",
        )

    @staticmethod
    def _raise_not_a_step(env: Mapping[str, str]) -> NoReturn:
        if env.get("SLURM_JOB_ID", "").strip():
            step = SlurmDetector.step(env)
            where = (f"in the special step {step[0]}={step[1]!r}" if step else
                     "in the batch script or an salloc shell (SLURM_JOB_ID is set, SLURM_STEP_ID is not)")
            raise LauncherError(
                f"launcher 'slurm' was forced but this process runs {where}, which is one process, not a task "
                "of a job step. Start the script with `srun python script.py` inside the job (or use "
                "launcher='auto' to self-spawn on this node)")
        raise LauncherError(
            "launcher 'slurm' was forced but SLURM_JOB_ID, SLURM_STEP_ID and SLURM_PROCID are not set: this "
            "process was not started by srun. Run `srun -N<nodes> --ntasks-per-node=<n> python script.py` "
            "or use launcher='auto'")

    @staticmethod
    def _master_addr(env: Mapping[str, str]) -> tuple[str, str]:
        if env.get("MASTER_ADDR", "").strip():
            return env["MASTER_ADDR"].strip(), "from MASTER_ADDR"
        var = first_set(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if var is None:
            raise LauncherError("a SLURM step without SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST: "
                                "cannot tell the master node; set MASTER_ADDR to the first node's host name")
        try:
            first = expand_hostlist(env[var])[0]
        except LauncherError as exc:
            raise LauncherError(f"{var}={env[var]!r}: {exc}; set MASTER_ADDR to the first node's host name") from None
        return first, f"= first host of {var}={env[var]}"

    @staticmethod
    def _master_port(env: Mapping[str, str]) -> tuple[int, str]:
        if env.get("MASTER_PORT", "").strip():
            return env_port(env, "MASTER_PORT"), "from MASTER_PORT"
        if not env.get("SLURM_JOB_ID", "").strip():
            raise LauncherError("a SLURM step without SLURM_JOB_ID: cannot derive a rendezvous port; set MASTER_PORT")
        step = SlurmDetector.step(env)
        step_id = int(step[1]) if step and step[1].isdigit() else 0
        job = env["SLURM_JOB_ID"].strip()
        # Mix the step in so that two steps of one job running side by side (`srun ... &` twice) do not meet
        # on the same port; every task of one step computes the same value.
        key = str(int(job) * 31 + step_id) if job.isdigit() else f"{job}.{step_id}"
        return derive_port(key), f"{derive_port(key)} derived from SLURM_JOB_ID={job}, step {step_id}"


SLURM: Final = SlurmDetector()
