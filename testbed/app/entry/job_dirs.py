"""A sweep job's folder name from its overrides, safe as one path component.

Hydra names a job's folder `hydra.sweep.subdir`, by default here `<job number>_<override_dirname>`,
and `override_dirname` is the job's overrides joined verbatim (hydra/_internal/config_loader_impl.py:588,
`get_overrides_dirname`), which Hydra then `os.path.join`s onto the sweep folder
(hydra/core/utils.py:125, `run_job`). So a file-valued override nests the folder
(`trace.path=azure_llm_2023/x.csv` -> `0_trace.path=azure_llm_2023/x.csv`, two levels deep), an
absolute path nests it further, and `..` climbs out of it: `-m policy=vllm,static
trace.path=../../d/x.csv` made both jobs write one folder outside the sweep, one policy's results
overwriting the other's, and the sweep's table found no job folder at all.

The `safe_dirname` resolver (conf/config.yaml: `hydra.sweep.subdir`) keeps the name readable and makes
it one component: every character outside letters, digits and `. _ , = + -` becomes `_` (`/`, `\\`,
spaces, quotes, `:`, `*`, non-ASCII ...), so no `/` nests it and no `..` component remains; trailing
dots become one `_` (Windows refuses them, and `..` alone is the parent folder); and a name longer than
MAX_CHARS is shortened (each long value to its tail, then the whole cut), with a short hash of the whole
value appended so that shortened names still differ where the overrides do. The job number in
front keeps every job's folder its own; the exact overrides stay in the job's `.hydra/overrides.yaml`
and in the sweep's table.
"""
from __future__ import annotations

import hashlib
import re

MAX_CHARS = 160  # of the overrides' part: below the 255 bytes a file name may have, with room for a prefix
VALUE_CHARS = 32  # a longer value, in a name too long, keeps its tail (a path's file name), marked by a leading '_'
_UNSAFE = re.compile(r"[^A-Za-z0-9._,=+-]+", re.ASCII)


def safe_dirname(value: object) -> str:
    """`value` (the job's override_dirname) as one readable, portable path component (see the module)."""
    text = "" if value is None else str(value)
    name = _UNSAFE.sub("_", text)
    if len(name) > MAX_CHARS:
        digest = hashlib.sha256(text.encode()).hexdigest()[:8]
        name = f"{_short_values(name)[:MAX_CHARS - len(digest) - 1]}-{digest}"
    return re.sub(r"\.+$", "_", name)  # ('..' alone, or a name ending in dots: never '.', '..' or a trailing dot)


def _short_values(name: str) -> str:
    """Each `key=value` item of `name` (items joined by ',', Hydra's item_sep) with a value of more than
    VALUE_CHARS cut to its tail: the part of a path that tells two files apart is usually its end."""
    items = []
    for item in name.split(","):
        key, eq, value = item.partition("=")
        items.append(f"{key}{eq}_{value[1 - VALUE_CHARS:]}" if eq and len(value) > VALUE_CHARS else item)
    return ",".join(items)
