"""tox's inline plugin for this project (tox 4 loads ``toxfile.py`` beside tox.ini).

``tox -p`` with no number runs as many environments at once as the machine has CPUs, the
default of tox's own ``tox run-parallel``, instead of all of them at once.  The envs here are
CPU-bound (JAX tracing, NumPy tolerance loops, framework imports): five of them on two cores
took a quarter more CPU time than two at a time, and finished later
(benchmarks/results/2026-12-02-jax-history.md, "Warm tox -p").
With fewer CPUs than envs, tox starts them in tox.ini's ``env_list`` order (jax, the longest, first).
``tox -p all`` (or a number) is obeyed as given.
"""

from __future__ import annotations

from typing import Any

from tox.plugin import impl


def _asked_for_all(args: Any) -> bool:
    """Whether the command line says ``-p all`` / ``--parallel all`` / ``--parallel=all``."""
    args = [str(a) for a in args or ()]
    for i, arg in enumerate(args):
        if arg in ("-p", "--parallel") and i + 1 < len(args) and args[i + 1] == "all":
            return True
        if arg in ("-pall", "--parallel=all"):
            return True
    return False


@impl
def tox_add_core_config(core_conf: Any, state: Any) -> None:
    options = state.conf.options
    if getattr(options, "parallel", 0) is None and not _asked_for_all(getattr(state, "args", ())):
        from tox.util.cpu import auto_detect_cpus

        options.parallel = auto_detect_cpus()
