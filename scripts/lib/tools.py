"""The check scripts' one way to their Python tools: the virtual environment scripts/setup
makes from scripts/requirements.txt.

`ensure(script, modules)` imports `modules`; when one is missing and this Python is not the
environment's, it runs scripts/setup (idempotent: it installs only what is missing) and
re-executes the script with the environment's Python, so `scripts/check-kubernetes` works
when run by hand too. Inside the environment a missing module is an error naming it.
"""

import importlib
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_REEXEC = "FORKFLEET_TOOLS_REEXEC"


def ensure(script, modules, commands=()):
    """The modules, imported; with `commands`, also commands the environment installs
    beside its python (hadolint)."""
    missing = next((c for c in commands if not os.access(_beside(c), os.X_OK)), None)
    if missing is None:
        try:
            return [importlib.import_module(m) for m in modules]
        except ImportError as e:
            missing = e.name or str(e)
    if os.environ.get(_REEXEC):
        sys.exit(f"{script}: {missing} is missing from the Python of {sys.executable}; "
                 f"run scripts/setup (it installs scripts/requirements.txt)")
    python = setup(script, f"{missing} is needed").get("FORKFLEET_PYTHON")
    if not python:
        sys.exit(f"{script}: scripts/setup printed no FORKFLEET_PYTHON; {missing} is needed")
    os.environ[_REEXEC] = "1"
    os.execv(python, [python, *sys.argv])


def setup(script, why):
    """Runs scripts/setup (idempotent) and returns what it printed, `NAME=value` lines as a
    dict (FORKFLEET_PYTHON, FORKFLEET_NATS_SERVER)."""
    done = subprocess.run([os.path.join(ROOT, "scripts", "setup")], stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"{script}: scripts/setup failed (exit {done.returncode}); {why}")
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def _beside(name):
    return os.path.join(os.path.dirname(sys.executable), name)


def executable(name):
    """The path of a command the environment installed beside its python (after `ensure`
    named it in `commands`)."""
    return _beside(name)
