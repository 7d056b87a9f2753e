"""Optional extras: a feature's package is imported where the feature runs, never at module import.

`make demo` installs only the `cpu` and `tb` extras, so a module that every config imports (a
role, the shell, the node) must import without the others. A feature that needs one calls

    peft = require("peft", "LoRA training (roles.trainer.lora)")

which returns the module, or raises MissingExtra naming the extra to install. `laminar-node check`
and the start of a role ask `missing_extras(config)` first, so a config that asks for a feature
whose package is absent is refused before anything starts, with the same line.
"""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# package -> the extra of pyproject.toml that installs it
EXTRA_OF = {
    "peft": "lora",
    "wandb": "tracking",
    "mlflow": "tracking",
    "ucxx": "ucx",
    "httpx": "reward",
    "tensorboardX": "tb",
    "gguf": "smollm2",
}


class MissingExtra(ImportError):
    """A feature asked for needs an optional package that is not installed."""


def install_hint(package: str) -> str:
    """The command that installs `package`'s extra."""
    return f"pip install -e '.[{EXTRA_OF.get(package, package)}]'"


def missing_message(package: str, feature: str) -> str:
    return f"{feature} needs the {package} package, which is not installed: {install_hint(package)}"


def available(package: str) -> bool:
    """True when `package` can be imported (found on the path; not imported here)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def require(package: str, feature: str) -> ModuleType:
    """Import `package` (a dotted name is fine) for `feature`, or raise MissingExtra naming its extra."""
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        top = package.split(".")[0]
        if exc.name is not None and exc.name.split(".")[0] != top:
            raise  # the package is there but one of its own dependencies is not: that error is the truth
        raise MissingExtra(missing_message(top, feature)) from None


def missing_extras(cfg, role: tuple[str, str] | None = None) -> list[str]:
    """One line per feature the run config asks for whose package is not installed (field, why);
    with `role` = (kind, id), only that role's features."""
    out = []
    asked = []
    if cfg.tracking is not None and role is None:
        if cfg.tracking.wandb is not None:
            asked.append(("tracking.wandb", "wandb", "W&B tracking"))
        if cfg.tracking.mlflow is not None:
            asked.append(("tracking.mlflow", "mlflow", "MLflow tracking"))
    placed = {(s.role, s.id) for _, s in cfg.placements()}
    for kind, id_ in placed if role is None else [role]:
        try:
            settings = cfg.settings_of(kind, id_)
        except Exception:  # an invalid role's settings are reported by the schema check
            continue
        asked += [(f"roles.{kind}.{field}", pkg, what) for field, pkg, what in _asks(kind, settings)]
    seen = set()
    for where, pkg, what in sorted(asked):
        if (where, pkg) in seen or available(pkg):
            continue
        seen.add((where, pkg))
        out.append(f"{cfg.source}: {where}: {missing_message(pkg, what)}")
    return out


def _asks(role: str, settings) -> list[tuple[str, str, str]]:
    """(field, package, feature) of the optional features a role's settings turn on."""
    out = []
    if role == "trainer" and getattr(settings, "lora", None) is not None:
        out.append(("lora", "peft", "LoRA training"))   # rollouts serve adapters with vLLM's own LoRA
    if role == "reward" and getattr(settings, "backend", None) == "http":
        out.append(("backend", "httpx", "the HTTP reward backend"))
    publishing = getattr(settings, "publishing", None) if role == "trainer" else None
    for field, value in (("transport", getattr(settings, "transport", None)),
                         ("publishing.transport", getattr(publishing, "transport", None))):
        if value == "ucx":
            out.append((field, "ucxx", "the UCX weight transport"))
    return out
