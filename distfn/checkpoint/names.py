"""The names checkpoints are recognised by, each defined once (a leaf: every module of the package may import it).

`layout` (paths, step families), `remote` (which directory a lease guards), `storage` (the pickle refusal) and
`api` (the pickle-looking-name warning) all read these; two copies of one list had drifted apart before (issue 40).
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["INDEX", "PICKLE_SUFFIXES", "STEP_DIR", "STEP_FILE", "SUFFIX"]

#: A sharded checkpoint's index file (the Hugging Face name, so `transformers` and `safetensors` tooling find it).
INDEX: Final = "model.safetensors.index.json"
#: The suffix of one-file checkpoints (and the rule of ``ctx.save``: no suffix in ``mode="fsdp"`` means sharded).
SUFFIX: Final = ".safetensors"
#: Names that other tools read as ``torch.save`` / pickle files: a save under one warns (its content is
#: safetensors), a load of one that is not safetensors is refused with the conversion (never unpickled).
PICKLE_SUFFIXES: Final = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".tar")
#: ``<prefix><step>.safetensors`` files and ``<prefix><step>`` directories.
STEP_FILE: Final = re.compile(r"^(?P<prefix>.*?)(?P<step>\d+)\.safetensors$")
STEP_DIR: Final = re.compile(r"^(?P<prefix>.*?)(?P<step>\d+)$")
