"""distfn's launchers, side by side; none imports another.

* `local`: a job's ranks as processes of this machine (fork, forkserver, spawn), for a self-spawned job and for
  this node's part of a per-node launch;
* `pernode`: the rule of a per-node launch (one task per node + local workers with global ranks) and its layout;
* `ray`: the ranks as Ray actors on a Ray cluster (its rules without Ray, which planning asks: `ray_rules`);
* `forkserver`: the fork server that forkserver workers fork from, started early where a call will need it.

Beneath them: `protocol`, what every rank does around the user's function and how a launcher reads its one report
(the rank variables, the store on a pre-bound socket, the value, early exits, the settle window, the root cause
first), and `shipping`, how the function, ``cfg`` and the value travel by pickle (by name, or by
value with cloudpickle), and `lifeline`, ``PR_SET_PDEATHSIG`` (no orphans), light enough for the fork server,
which decoration imports. Which launcher a call uses is decided by `distfn.plan`; adding a launcher is adding a
module here and a kind there.
"""
