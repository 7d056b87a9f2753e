"""Secrets in the run config: where they come from, and how they stay out of logs, trackers and
generated files (docs/security.md).

A secret (the HTTP scorer's Authorization header, an API key a service needs) is never written in
the config. The config names where it is,

    {env: NAME}    an environment variable of the role's process
    {file: PATH}   a file of the user running the role, mode 0600 (checked as key files are)

and the role reads it when it starts using it (`resolve`). So the config itself, which every role
logs at start (`config_resolved`), which trackers receive and which `laminar-node slurm` embeds in
its script, holds the reference, never the value.

Two more lines of defence, for fields this code does not know (an environment's `options`): a
field whose name says it is secret (`looks_secret`: authorization, token, password, api key,
cookie, credential...) holding a literal string is replaced by "***" in what is logged or sent to
a tracker (`redact`), and `laminar-node slurm` refuses to copy one into its files
(`literal_secrets` names them). A name ending in `_file`, `_path`, `_env`, `_dir` or `_id` is a
reference or an identifier, not a secret (`metrics_token_file`, a simulator's `token_id`).
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

REDACTED = "***"
_WORDS = {"authorization", "auth", "token", "secret", "password", "passwd", "apikey", "cookie", "credential",
          "credentials", "passphrase", "bearer"}
_PAIRS = {("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key"), ("client", "secret")}
_REFERENCES = {"file", "path", "env", "dir", "id", "ids", "field", "name", "url"}


class SecretRef(BaseModel):
    """Where a secret is: an environment variable or a private file, never the value itself."""
    model_config = ConfigDict(extra="forbid")
    env: str | None = Field(None, description="name of the environment variable that holds it")
    file: str | None = Field(None, description="path of a file (mode 0600, the role's user's) that holds it; "
                             "leading and trailing white space is dropped")

    @model_validator(mode="after")
    def _one(self):
        if (self.env is None) == (self.file is None):
            raise ValueError("a secret reference names exactly one of env or file")
        return self


def looks_secret(name: str) -> bool:
    """Whether a field or header name says its value is a secret (module docstring)."""
    parts = [p for p in re.split(r"[^a-z0-9]+", str(name).lower()) if p]
    if not parts or parts[-1] in _REFERENCES:
        return False
    return bool(_WORDS & set(parts)) or any(pair in _PAIRS for pair in zip(parts, parts[1:], strict=False))


def resolve(ref: SecretRef | str, where: str) -> str:
    """The secret a reference points at (a plain string is returned as it is); raises naming
    `where` (the field) when the variable is unset or the file is not private."""
    if isinstance(ref, str):
        return ref
    if ref.env is not None:
        if ref.env not in os.environ:
            raise KeyError(f"{where}: environment variable {ref.env} is not set in this role's environment")
        return os.environ[ref.env]
    path = Path(ref.file)
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"{where}: {path} must be a regular file of uid {os.geteuid()} that only it can "
                              f"read: `chmod 600 {path}`")
    return path.read_text().strip()


def literal_secrets(obj: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every secret-named field holding a literal string (not a reference)."""
    out: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            path = f"{prefix}{k}"
            if isinstance(v, str) and looks_secret(k):
                out.append(path)
            else:
                out += literal_secrets(v, path + ".")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += literal_secrets(v, f"{prefix[:-1]}[{i}].")
    return out


def redact(obj: Any) -> Any:
    """A copy of `obj` (dicts, lists, scalars) with every literal under a secret-named key as "***"."""
    if isinstance(obj, dict):
        return {k: REDACTED if isinstance(v, str) and looks_secret(k) else redact(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj


def no_literal_secret(values: dict[str, Any], where: str) -> None:
    """Refuse a literal under a secret-like name in `values` (a headers dict, say), naming the field."""
    bad = [k for k, v in values.items() if isinstance(v, str) and looks_secret(k)]
    if bad:
        raise ValueError(f"{where}.{bad[0]}: a secret is never written in the config: give "
                         f"{{env: VARIABLE}} or {{file: PATH}} (a 0600 file) instead")
