"""A zygote for the extraction fault tests: imports torch, transformers and agnosia once, then
forks one real extraction process per request, so killing and resuming it ten times costs
seconds, not a minute of imports.

Protocol: JSON lines on stdin, answers on stdout.

* ``{"op": "run", "argv": [...], "log": PATH, "progress": PATH, "batch_sleep": S, "fsize_limit": B,
  "env": {...}}`` forks a child that runs ``python -m extract ARGV`` (``extract.__main__.main``) with
  stdout and stderr in ``log`` and ``env`` added to its environment. Each queued batch appends a line to
  ``progress`` and then sleeps ``S``
  seconds (a slow model: kills land between batches and commits, not only in the set-up).
  SIGXFSZ is ignored in the child, so once its RLIMIT_FSIZE is lowered (``B`` bytes from the
  start, or later by the test with ``prlimit``) a write past the limit fails with EFBIG, as on a
  full disk. Answers ``{"pid": PID}``.
* ``{"op": "wait", "pid": PID}`` reaps the child: ``{"pid": PID, "rc": RC}`` (``-9`` when killed).
* ``{"op": "quit"}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)

import transformers  # noqa: E402,F401
from transformers import AutoModelForImageTextToText, AutoProcessor  # noqa: E402,F401
from transformers.utils import logging as hf_logging  # noqa: E402

import extract.__main__ as cli  # noqa: E402
import extract.run  # noqa: E402
from extract.models.adapters import registry  # noqa: E402

registry()  # every adapter's family module (the toy's among them) imported here, once
hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()


def _child(cmd: dict) -> int:
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # Ctrl-C as `python -m extract` run from a shell gets it. Python installs this handler only if
    # SIGINT was not ignored at its start, and a shell starts background jobs (`cmd &`, nohup)
    # with SIGINT ignored: a test run launched that way once saw its child finish through the
    # Ctrl-C test's signal.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.update(cmd.get("env") or {})
    if cmd.get("fsize_limit") is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (cmd["fsize_limit"], resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    progress, pause = cmd.get("progress"), cmd.get("batch_sleep") or 0.0
    real = extract.run.run_extraction

    def on_batch(done: int) -> None:
        if progress:
            with open(progress, "a") as f:
                f.write(f"{done}\n")
        if pause:
            time.sleep(pause)

    def run_extraction(*args, **kwargs):
        kwargs["on_batch"] = on_batch
        return real(*args, **kwargs)

    extract.run.run_extraction = run_extraction
    return cli.main(cmd["argv"])


def main() -> None:
    out = sys.stdout
    print(json.dumps({"ready": True, "pid": os.getpid()}), file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            return
        if cmd["op"] == "wait":
            _, status = os.waitpid(cmd["pid"], 0)
            rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            print(json.dumps({"pid": cmd["pid"], "rc": rc}), file=out, flush=True)
            continue
        pid = os.fork()
        if pid == 0:  # the extraction process
            rc = 3
            try:
                fd = os.open(cmd["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                sys.stdout = os.fdopen(1, "w", buffering=1)
                sys.stderr = os.fdopen(2, "w", buffering=1)
                rc = _child(cmd)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001 - the log shows it; the rc says it
                traceback.print_exc()
                rc = 3
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(rc)
        print(json.dumps({"pid": pid}), file=out, flush=True)


if __name__ == "__main__":
    main()
