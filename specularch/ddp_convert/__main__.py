"""CLI: ``python -m specularch.ddp_convert train.py -o train_ddp.py`` or ``--run N [args]``."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from .rewrite import convert
from .rules import Refused


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specularch.ddp_convert",
                                     description="Convert a single-process PyTorch training script "
                                                 "into a torch.distributed one.")
    parser.add_argument("script")
    parser.add_argument("-o", "--output", help="where to write the converted script")
    parser.add_argument("--run", type=int, metavar="N", help="launch it with torchrun on N processes")
    parser.add_argument("--no-lr-scaling", action="store_true", help="keep the learning rate as is")
    parser.add_argument("--no-ddp", action="store_true",
                        help="no DDP: specularch optimizes the step function holding "
                             "backward() and averages gradients inside it (the step must be a "
                             "top-level function called per batch)")
    options, script_args = parser.parse_known_args(argv)  # the rest goes to the script
    with open(options.script) as f:
        source = f.read()
    try:
        converted, reports = convert(source, scale_lr=not options.no_lr_scaling,
                                     wrap_ddp=not options.no_ddp)
    except Refused as e:
        print(f"{options.script}:{e.line}: cannot convert: {e.rule}: {e.why}", file=sys.stderr)
        return 2
    for line, rule, what in reports:
        print(f"{options.script}:{line}: [{rule}] {what}", file=sys.stderr)
    output, folder = options.output, None
    if output is None and options.run:
        # A folder of its own: the folder of the script run is the first place its imports
        # are looked for, and the system temp folder may hold anything (a stray ``nt.py``
        # there made torch's own import fail).
        folder = tempfile.mkdtemp(prefix="specularch_ddp_")
        name = os.path.splitext(os.path.basename(options.script))[0]
        output = os.path.join(folder, f"{name}_distributed.py")
    if output is None:
        sys.stdout.write(converted)
        return 0
    with open(output, "w") as f:
        f.write(converted)
    if not options.run:
        return 0
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={options.run}", output, *script_args]
    print("running: " + " ".join(command), file=sys.stderr)
    try:
        return subprocess.call(command, env=_importing_beside(options.script))
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _importing_beside(script: str) -> dict:
    """The environment for the converted script: the original's folder first on
    ``PYTHONPATH``, so its imports of modules beside it work as in the original."""
    here = os.path.dirname(os.path.abspath(script))
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([here, path]) if path else here)


if __name__ == "__main__":
    sys.exit(main())
